"""A webhook receiver for the publisher's connection figures (docs/benchmarks-changes.md item 28).

An HTTP/1.1 keep-alive server on asyncio that answers every POST with 200
after ``--delay`` seconds, optionally over TLS, and prints once a second how
many TCP (or TLS) connections it has accepted, how many requests it has
answered and how many connections are open. Point ``OUTBOX_PUBLISHER`` at
it (with ``OUTBOX_WEBHOOK_VERIFY=<cert>`` for TLS) and compare the
connections per message.

    python -m benchmarks.slow_receiver --port 18443 --delay 0.03 \\
        --cert cert.pem --key key.pem
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import time
from dataclasses import dataclass


@dataclass
class Counts:
    connections: int = 0
    requests: int = 0
    open: int = 0
    peak: int = 0


async def _serve(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, counts: Counts
) -> None:
    counts.connections += 1
    counts.open += 1
    counts.peak = max(counts.peak, counts.open)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            await asyncio.sleep(delay)
            counts.requests += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        pass  # the client closed the connection
    finally:
        counts.open -= 1
        writer.close()


async def _report(counts: Counts) -> None:
    while True:
        await asyncio.sleep(1.0)
        print(
            f"{time.time():.0f} connections={counts.connections} requests={counts.requests} "
            f"open={counts.open} peak={counts.peak}",
            flush=True,
        )


async def main(port: int, delay: float, cert: str | None, key: str | None) -> None:
    tls = None
    if cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(cert, key)
    counts = Counts()
    server = await asyncio.start_server(
        lambda r, w: _serve(r, w, delay, counts), "127.0.0.1", port, backlog=4096, ssl=tls
    )
    async with server:
        await asyncio.gather(server.serve_forever(), _report(counts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--delay", type=float, default=0.03, help="seconds per response")
    parser.add_argument("--cert", help="PEM certificate: serve TLS")
    parser.add_argument("--key", help="PEM private key of --cert")
    args = parser.parse_args()
    asyncio.run(main(args.port, args.delay, args.cert, args.key))
