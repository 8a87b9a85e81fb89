"""The arguments vLLM is started with, worked out without starting (or importing) vLLM."""

import subprocess
import sys

import pytest

from gearshift.rollout import RolloutArgs
from gearshift_vllm.arguments import (DEFAULT_CPU_KV_CACHE_BYTES, VLLMOptions, engine_arguments,
                                      fitting_lora_rank)


def arguments(args=None, options=None, **where):
    where = {"tp": 1, "world_size": 1, "on_gpu": False, **where}
    return engine_arguments(args or RolloutArgs(model="m"), options or VLLMOptions(), **where)


def test_cpu_defaults_in_one_process():
    kwargs = arguments(RolloutArgs(model="m", seed=3, max_model_len=256))
    assert kwargs["model"] == "m" and kwargs["seed"] == 3 and kwargs["max_model_len"] == 256
    assert kwargs["logprobs_mode"] == "raw_logprobs"
    assert kwargs["kv_cache_memory_bytes"] == DEFAULT_CPU_KV_CACHE_BYTES
    assert "distributed_executor_backend" not in kwargs and "enable_sleep_mode" not in kwargs
    assert "enable_lora" not in kwargs


def test_several_ranks_run_under_the_external_launcher_and_tp_is_the_mesh():
    kwargs = arguments(tp=2, world_size=4)
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == 2


def test_gpu_sleeps_and_takes_its_share_of_memory_unless_given_bytes():
    kwargs = arguments(options=VLLMOptions(gpu_memory_utilization=0.3), on_gpu=True)
    assert kwargs["enable_sleep_mode"] and kwargs["gpu_memory_utilization"] == 0.3
    assert "kv_cache_memory_bytes" not in kwargs
    assert arguments(options=VLLMOptions(kv_cache_bytes=1 << 20), on_gpu=True)["kv_cache_memory_bytes"] == 1 << 20


def test_cuda_graphs_on_a_gpu_and_eager_on_a_cpu_unless_the_option_says():
    assert arguments(on_gpu=True)["enforce_eager"] is False
    assert arguments(on_gpu=False)["enforce_eager"] is True
    assert arguments(options=VLLMOptions(enforce_eager=True), on_gpu=True)["enforce_eager"] is True
    assert arguments(options=VLLMOptions(enforce_eager=False), on_gpu=False)["enforce_eager"] is False


def test_engine_kwargs_go_last_and_as_they_are():
    kwargs = arguments(options=VLLMOptions(engine_kwargs={"enforce_eager": False, "swap_space": 0}))
    assert kwargs["enforce_eager"] is False and kwargs["swap_space"] == 0


def test_adapters_take_the_smallest_rank_vllm_serves_that_holds_them():
    kwargs = arguments(RolloutArgs(model="m", max_lora_rank=12), lora_ranks=[8, 16, 32])
    assert kwargs["enable_lora"] and kwargs["max_loras"] == 1 and kwargs["max_lora_rank"] == 16
    assert fitting_lora_rank(12, None) == 12
    with pytest.raises(ValueError, match="up to rank 32"):
        fitting_lora_rank(64, [8, 16, 32])


@pytest.mark.parametrize("args, options, on_gpu, match", [
    (RolloutArgs(model="m", max_lora_rank=8), VLLMOptions(), True, "float16 or bfloat16"),
    (RolloutArgs(model="m", max_lora_rank=8), VLLMOptions(cpu_weights="packed"), False, "plain weight layout"),
    (RolloutArgs(model="m"), VLLMOptions(cpu_weights="plain", engine_kwargs={"load_format": "dummy"}), False,
     "needs cpu_weights='packed'"),
])
def test_combinations_vllm_would_fail_on_are_refused_naming_the_option(args, options, on_gpu, match):
    with pytest.raises(ValueError, match=match):
        arguments(args, options, on_gpu=on_gpu)


def test_working_them_out_imports_no_vllm():
    code = ("import sys; from gearshift.rollout import RolloutArgs; "
            "from gearshift_vllm.arguments import VLLMOptions, engine_arguments; "
            "engine_arguments(RolloutArgs(model='m', max_lora_rank=8), VLLMOptions(cpu_weights='plain'), tp=1, "
            "world_size=1, on_gpu=False, lora_ranks=[8]); "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
