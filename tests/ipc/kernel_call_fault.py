"""A native fault in a kernel call as kernels.py makes one, without building the kernels.

`python kernel_call_fault.py REPORT KERNELS_PY caller|thread`: a function compiled under
kernels.py's path (as a kernel's wrapper is) calls into C, and C faults while faulthandler
writes to REPORT. With `thread`, a thread that C started (as an OpenMP worker is) faults,
strlen(NULL) being its body, while the Python thread waits in pthread_join; with `caller`,
the calling thread faults in strlen(NULL). A Python thread sleeps beside it as a bystander.
"""

import ctypes
import faulthandler
import sys
import threading
import time
from typing import Any

WRAPPER = """
def decode_attention_bf16(on_a_thread):
    if not on_a_thread:
        return libc.strlen(None)
    tid = ctypes.c_ulong()
    libc.pthread_create(ctypes.byref(tid), None, ctypes.cast(libc.strlen, ctypes.c_void_p), None)
    return libc.pthread_join(tid, None)
"""


def forward(kernels: dict[str, Any], on_a_thread: bool) -> None:
    kernels["decode_attention_bf16"](on_a_thread)


def main() -> None:
    report, kernels_py, thread = sys.argv[1:4]
    faulthandler.enable(open(report, "w"), all_threads=True)  # noqa: SIM115 (held until death)
    threading.Thread(target=lambda: time.sleep(60), name="bystander", daemon=True).start()
    time.sleep(0.05)
    kernels: dict[str, Any] = {"ctypes": ctypes, "libc": ctypes.CDLL(None)}
    exec(compile(WRAPPER, kernels_py, "exec"), kernels)
    forward(kernels, thread == "thread")


if __name__ == "__main__":
    main()
