"""What several test modules share that is not a fixture: a raw HTTP/2 test client, hostile h2
frames, the README's command lines, run directories made without a stack. Imported by its
package path (``tests.support.x``); ``pytest``'s ``pythonpath`` puts the repository root first."""
