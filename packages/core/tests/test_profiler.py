"""What the profiler reports of memory."""


def test_a_steps_peak_is_the_highest_device_sample_or_the_process_high_water_mark_without_one():
    from gearshift.profiler import device_used_bytes, peak_memory_bytes, step_peak_bytes

    assert step_peak_bytes([3 << 30, None, 5 << 30]) == 5 << 30
    if device_used_bytes() is None:  # no CUDA: the resident-set high-water mark, which grows with the process
        assert step_peak_bytes([None, None]) >= 1 << 20
        assert abs(step_peak_bytes([]) - peak_memory_bytes()) < 64 << 20
