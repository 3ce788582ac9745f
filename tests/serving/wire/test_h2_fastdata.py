"""``H2State``'s DATA fast path and its receive path are h2's to the byte: the same frames out, the
same windows, stream states, events and errors as ``h2.connection.H2Connection`` itself, whatever
the sizes, the windows, the peer's frame size, END_STREAM, padding and stream state."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.exceptions
import h2.settings
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.wire.h2base import H2State

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
SERVER = h2.config.H2Configuration(client_side=False, header_encoding=None)
CLIENT = h2.config.H2Configuration(client_side=True, header_encoding=None)


def _served(conn: h2.connection.H2Connection, client: h2.connection.H2Connection) -> None:
    conn.initiate_connection()
    conn.receive_data(client.data_to_send())


def _twins(
    window: int, frame_size: int, remote_ended: bool
) -> tuple[h2.connection.H2Connection, H2State, h2.connection.H2Connection]:
    """h2's server and ours, each fed the same client bytes: a preface whose settings give a
    stream window ``window`` and frame size ``frame_size``, and one request (ended or not)."""
    client = h2.connection.H2Connection(CLIENT)
    client.local_settings = h2.settings.Settings(
        client=True,
        initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: frame_size,
        },
    )
    client.initiate_connection()
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, REQUEST, end_stream=remote_ended)
    data = client.data_to_send()
    plain, ours = h2.connection.H2Connection(SERVER), H2State(SERVER)
    for conn in (plain, ours):
        conn.initiate_connection()
        conn.receive_data(data)
        conn.send_headers(sid, [(b":status", b"200")])
        conn.data_to_send()
    return plain, ours, client


def _state(conn: h2.connection.H2Connection) -> tuple[Any, ...]:
    stream = conn.streams.get(1)
    return (
        conn.outbound_flow_control_window,
        None
        if stream is None
        else (stream.state_machine.state, stream.outbound_flow_control_window),
        conn.state_machine.state,
    )


def _apply(conn: h2.connection.H2Connection, op: tuple[Any, ...]) -> Any:
    kind = op[0]
    try:
        if kind == "data":
            _, size, end, pad = op
            conn.send_data(1, b"x" * size, end_stream=end, pad_length=pad)
        elif kind == "window":
            conn.receive_data(op[1])
        else:
            conn.reset_stream(1)
    except h2.exceptions.ProtocolError as exc:
        return type(exc)
    return None


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("data"),
            st.integers(0, 40_000),
            st.booleans(),
            st.none() | st.integers(0, 20),
        ),
        st.tuples(st.just("window"), st.integers(1, 70_000), st.sampled_from([0, 1])),
        st.tuples(st.just("reset")),
    ),
    max_size=12,
)


@settings(deadline=None, max_examples=300)
@given(
    window=st.integers(0, 70_000),
    frame_size=st.sampled_from([16_384, 20_000, 65_535]),
    remote_ended=st.booleans(),
    steps=ops,
)
def test_sending_data_is_h2s_to_the_byte(
    window: int, frame_size: int, remote_ended: bool, steps: list[tuple[Any, ...]]
) -> None:
    plain, ours, client = _twins(window, frame_size, remote_ended)
    for step in steps:
        if step[0] == "window":  # a WINDOW_UPDATE from the client, on the stream or connection
            _, increment, stream_id = step
            try:
                client.increment_flow_control_window(increment, stream_id=stream_id or None)
            except (h2.exceptions.ProtocolError, h2.exceptions.FlowControlError):
                continue
            step = ("window", client.data_to_send())
        got = _apply(plain, step), _apply(ours, step)
        assert got[0] == got[1], step
        assert plain.data_to_send() == ours.data_to_send(), step
        assert _state(plain) == _state(ours), step


def test_the_fast_path_is_taken_for_a_token_sized_frame_and_matches() -> None:
    plain, ours, _ = _twins(65_535, 16_384, remote_ended=True)
    for conn in (plain, ours):
        conn.send_data(1, b"data: token\n\n")
        conn.send_data(1, b"data: [DONE]\n\n", end_stream=True)
    assert plain.data_to_send() == ours.data_to_send()
    assert _state(plain) == _state(ours)
    assert ours.streams[1].closed
