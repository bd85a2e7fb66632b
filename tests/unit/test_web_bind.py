"""conductor.web.bind: the connections it accepts send small writes at once (TCP_NODELAY)."""

from __future__ import annotations

import asyncio
import socket

from conductor import web


def test_connections_accepted_on_a_bound_socket_have_nagle_off() -> None:
    # With Nagle on, uvicorn's answer (headers, then body: two writes) waits for the client's
    # delayed ACK, ~40 ms a call; asyncio turns it off only on sockets whose proto says TCP.
    async def main() -> int:
        sock = web.bind("127.0.0.1", 0)
        got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            s = writer.get_extra_info("socket")
            got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        async with server:
            _, w = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(got, 5)
            w.close()
        return value

    assert asyncio.run(main()) != 0
