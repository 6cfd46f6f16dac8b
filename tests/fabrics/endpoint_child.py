"""A target process for the fabric tests: ``python endpoint_child.py TRANSPORT REGION_BYTES``.

Registers a zeroed region with the transport, prints its description as one JSON line, then
keeps the transport progressing. Commands on stdin, one per line: ``hex OFFSET NUM_BYTES``
prints that slice of the region in hex (so a test sees what landed in this process's memory).
Exits when stdin closes.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

from meridian.disagg.transport import make_endpoint


def main(transport: str, region_bytes: int) -> None:
    region = np.zeros(region_bytes, np.uint8)
    endpoint = make_endpoint(transport, region)
    print(json.dumps(endpoint.describe()), flush=True)
    done = threading.Event()

    def serve_commands() -> None:
        for line in sys.stdin:
            command, offset, num_bytes = line.split()
            assert command == "hex"
            start = int(offset)
            print(region[start : start + int(num_bytes)].tobytes().hex(), flush=True)
        done.set()

    threading.Thread(target=serve_commands, daemon=True).start()
    while not done.is_set():
        endpoint.progress()
        time.sleep(endpoint.progress_interval_s)
    endpoint.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
