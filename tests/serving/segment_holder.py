"""A Mooncake client that only contributes memory to the store, standing in for the segment a
long-lived prefill pod keeps mounted; runs until terminated.

    python segment_holder.py MASTER_ADDRESS BYTES
"""

import signal
import sys
import time

from kvhelper.store import MooncakeConfig, MooncakeKVStore

if __name__ == "__main__":
    store = MooncakeKVStore(MooncakeConfig(master_server_address=sys.argv[1],
                                           global_segment_size=int(sys.argv[2]),
                                           local_buffer_size=16 << 20,
                                           local_hostname="127.0.0.1"))
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(1)
