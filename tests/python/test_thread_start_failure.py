"""A thread pool that cannot start its workers (the system's limits: here an address space
too small for the threads' stacks) is a clean error that says what failed and why, with
PYKV_ERR_NOMEM behind it; the context keeps working with the threads it had. Each case
runs in its own process, since the limit is the whole process's."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import resource, sys
    from pykv import Llama
    from pykv._ffi import lib
    from pykv.errors import BackendError

    path, what = sys.argv[1], sys.argv[2]
    llm = Llama(path, n_ctx=64, n_threads=1, verbose=False)
    mapped = 0
    for line in open("/proc/self/maps"):
        lo, hi = line.split()[0].split("-")
        mapped += int(hi, 16) - int(lo, 16)
    # room for a few worker stacks (8 MiB each by default), not for 200
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (160 << 20), resource.RLIM_INFINITY))
    try:
        if what == "set_threads":
            llm.set_threads(200)
        else:
            Llama(path, n_ctx=64, n_threads=200, verbose=False)
    except BackendError as e:
        assert e.status == lib.PYKV_ERR_NOMEM, e.status
        print("ERROR", e)
    else:
        print("NO ERROR")
    llm.eval([1, 2, 3])              # the context still runs on the threads it had
    print("EVAL", llm.n_past)
""")


@pytest.mark.parametrize("what", ["set_threads", "new_context"])
def test_failed_thread_start_is_reported(tiny_model, what):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model()), what],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "EVAL 3"
    error = next(line for line in lines if line.startswith(("ERROR", "NO ERROR")))
    assert error.startswith("ERROR"), out.stdout
    # which thread of how many, and the system's reason
    assert "worker thread" in error and "of 200" in error and "Resource temporarily unavailable" in error, error
