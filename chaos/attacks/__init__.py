"""The standing attack suite (issue 14): each attack on the replica, beside a healthy client.

``runner`` (the catalog, ``run_attack``, ``run_suite``), ``target`` (the ``zl-replica`` under
attack, its RSS and ``active``), ``healthy`` (the well-behaved SDK client, in a process of its
own), ``h2raw`` (the hostile HTTP/2 client), the attacks by kind (``floods``, ``streams``,
``connections``, ``tenancy``) and ``outcome`` (what passes, and why). ``zl-bench attack`` runs it.
"""
