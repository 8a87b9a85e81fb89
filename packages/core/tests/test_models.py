

def test_one_process_at_a_time_builds_a_preset(tmp_path):
    """A second job on a fresh cache waits for the first to finish the folder instead of reading it half-written."""
    import fcntl
    import subprocess
    import sys
    import time

    from gearshift.models import resolve_model

    code = f"from gearshift.models import resolve_model; print(resolve_model('tiny', {str(tmp_path)!r}))"
    first = resolve_model("tiny", tmp_path)  # built here; the lock file sits beside the folder
    lock = open(f"{first}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # as if another process were building it now
    try:
        waiting = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        time.sleep(5)
        assert waiting.poll() is None, "resolve_model went ahead while another process held the folder"
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    out, _ = waiting.communicate(timeout=120)
    assert out.strip() == first
