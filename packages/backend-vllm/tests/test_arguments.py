"""The arguments vLLM is started with, worked out without starting (or importing) vLLM."""

import subprocess
import sys

import pytest
import torch

from gearshift.rollout import KV_MARGIN, RolloutArgs
from gearshift_vllm.arguments import (DEFAULT_CPU_KV_CACHE_BYTES, VLLMOptions, engine_arguments,
                                      fitting_lora_rank, kv_bytes_per_token, kv_cache_for_batch)


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


def test_a_cpu_step_takes_whole_prompts_and_holds_the_longest():
    # a prompt split over steps makes vLLM rewind its seeded generator, which a CPU generator cannot do
    kwargs = arguments(RolloutArgs(model="m", max_model_len=256))
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 8192
    assert arguments(context=32768)["max_num_batched_tokens"] == 32768
    gpu = arguments(on_gpu=True, context=32768)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu


def test_several_ranks_run_under_the_external_launcher_and_tp_is_the_mesh():
    kwargs = arguments(tp=2, world_size=4)
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == 2


def test_gpu_sleeps_and_takes_its_share_of_memory_unless_given_bytes():
    kwargs = arguments(options=VLLMOptions(gpu_memory_utilization=0.3), on_gpu=True)
    assert kwargs["enable_sleep_mode"] and kwargs["gpu_memory_utilization"] == 0.3
    assert "kv_cache_memory_bytes" not in kwargs
    assert arguments(options=VLLMOptions(kv_cache_bytes=1 << 20), on_gpu=True)["kv_cache_memory_bytes"] == 1 << 20


def test_a_gpu_reserves_the_kv_cache_its_batch_needs_unless_the_options_say_otherwise():
    assert arguments(on_gpu=True, kv_for_batch=5 << 30)["kv_cache_memory_bytes"] == 5 << 30
    assert arguments(options=VLLMOptions(kv_cache_bytes=1 << 20), on_gpu=True,
                     kv_for_batch=5 << 30)["kv_cache_memory_bytes"] == 1 << 20
    assert "kv_cache_memory_bytes" not in arguments(options=VLLMOptions(kv_cache_to_batch=False), on_gpu=True,
                                                    kv_for_batch=5 << 30)
    assert arguments(on_gpu=False, kv_for_batch=5 << 30)["kv_cache_memory_bytes"] == DEFAULT_CPU_KV_CACHE_BYTES


def qwen2_7b():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064)


def test_the_kv_cache_for_a_batch_holds_every_token_once_with_a_margin():
    config = qwen2_7b()
    per_token = kv_bytes_per_token(config, torch.bfloat16)
    assert per_token == 2 * 28 * 4 * 128 * 2  # keys and values, 28 layers, 4 kv heads of 128, bf16
    assert kv_bytes_per_token(config, torch.bfloat16, tp=2) == per_token // 2
    # 32 prompts x 8 samples x (64 + 256) tokens: 4.7 GiB with the margin, where a 0.5 share of an H200 is 55
    need = kv_cache_for_batch(config, torch.bfloat16, batch_tokens=256 * 320, max_model_len=32768)
    assert need == int(256 * 320 * KV_MARGIN) * per_token
    halves = kv_cache_for_batch(config, torch.bfloat16, batch_tokens=256 * 320, max_model_len=4096, dp=2)
    assert halves == int(128 * 320 * KV_MARGIN) * per_token
    # never less than one sequence of the whole context
    assert kv_cache_for_batch(config, torch.bfloat16, batch_tokens=100, max_model_len=32768) == \
        int(32768 * KV_MARGIN) * per_token
    # left to vLLM's own rule: tokens unknown, or more than its share leaves
    assert kv_cache_for_batch(config, torch.bfloat16, batch_tokens=None, max_model_len=32768) is None
    assert kv_cache_for_batch(config, torch.bfloat16, batch_tokens=256 * 320, max_model_len=32768,
                              room=need - 1) is None


def test_attention_other_than_plain_layers_is_left_to_vllm():
    config = qwen2_7b()
    config.layer_types = ["sliding_attention"] + ["full_attention"] * 27
    assert kv_bytes_per_token(config, torch.bfloat16) is None
    assert kv_cache_for_batch(config, torch.bfloat16, batch_tokens=1000, max_model_len=4096) is None


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


def test_a_mixture_of_experts_is_refused_on_a_cpu_and_taken_on_a_gpu():
    from types import SimpleNamespace

    from transformers import MixtralConfig, Qwen2Config

    from gearshift_vllm.arguments import check_experts_on_cpu

    vllm = SimpleNamespace(__version__="0.x")
    with pytest.raises(ValueError, match=r"mixture-of-experts model \(8 experts a layer\).*rollout.backend=hf"):
        check_experts_on_cpu(vllm, MixtralConfig(num_local_experts=8), on_gpu=False)
    check_experts_on_cpu(vllm, MixtralConfig(num_local_experts=8), on_gpu=True)
    check_experts_on_cpu(vllm, Qwen2Config(), on_gpu=False)
