"""The benchmark package: its switch settings read as the run config reads them, the own-load hook it checks for,
and the switch benchmark on the reference pair."""

import pytest

from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.bench import OwnLoad, measure_pair, switch_settings
from gearshift.rl.config import Config, SwitchConfig
from gearshift.rl.config import SHARE


@pytest.mark.parametrize("share, offload", [("auto", "auto"), ("on", "none"), ("off", "optimizer, grads"),
                                            ("off", "")])
def test_switch_settings_are_the_run_config_own(share, offload):
    cfg = Config(switch=SwitchConfig(share=share, offload=offload))
    assert switch_settings(share, offload) == (SHARE[cfg.switch.share], cfg.offload_tags())


def test_switch_settings_read_tags_and_none():
    assert switch_settings("off", "optimizer,grads") == (False, ["optimizer", "grads"])
    assert switch_settings("auto", "none") == (None, [])


class Loads:
    def own_load(self, buckets):
        return 0


def test_own_load_is_a_hook_engines_may_have():
    assert isinstance(Loads(), OwnLoad)
    assert not isinstance(object(), OwnLoad)
    assert not hasattr(HFRolloutEngine, "own_load"), "the rollout interface no longer declares own_load"


def test_the_switch_benchmark_measures_a_pair_without_an_own_load(gearshift_model, tmp_path):
    train = TorchTrainEngine.build(gearshift_model, lr=1e-2)
    rollout = HFRolloutEngine.build(gearshift_model)
    try:
        bench = measure_pair(train, rollout, switches=1, naive_switches=1, naive_dir=str(tmp_path), share=False)
    finally:
        train.close()
        rollout.close()
    assert bench.engine_load_s > 0 and bench.copy_s > 0 and bench.sync_s > 0
    assert bench.bytes == rollout.weight_spec().nbytes  # one rank: every weight comes from itself
    assert "own load" in bench.table()


def test_bench_switch_takes_share_and_offload_as_the_run_config_does(gearshift_model, tmp_path, capsys):
    import json

    from gearshift.cli import main

    assert main(["bench", "switch", "--train", "torch", "--rollout", "hf", "--model", gearshift_model,
                 "--switches", "1", "--naive-switches", "1", "--share", "off", "--offload", "optimizer",
                 "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "switch-torch-hf-copy-optimizer.json").read_text())
    assert written["shared"] is False  # the hf engine could share the torch trainer's tensors: off copies
    phases = {p["name"] for p in written["to_rollout"]["phases"]}
    assert "offload" in phases, phases  # tags given: moved every switch (auto moves nothing on a CPU)
    assert "naive resharder" in capsys.readouterr().out


def test_a_switch_bench_without_the_naive_round_trip_says_so(gearshift_model, tmp_path, capsys):
    import json

    from gearshift.cli import main

    assert main(["bench", "switch", "--train", "torch", "--rollout", "hf", "--model", gearshift_model,
                 "--switches", "1", "--naive-switches", "0", "--share", "off", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "switch-torch-hf-copy.json").read_text())
    assert written["naive_over_sync"] is None and written["naive_s"] == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("naive resharder"))
    assert "not run (--naive-switches 0)" in line


def test_kernel_kinds_and_busy_time():
    from gearshift.bench.kernels import busy_seconds, kind_of

    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kind_of("flash_fwd_kernel") == "attention"
    assert kind_of("ncclDevKernel_AllGather_RING_LL") == "collective"
    assert kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "copy"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda>") == "other"
    # overlapping intervals count once, gaps not at all
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.4)]) == pytest.approx(3.0)
    assert busy_seconds([]) == 0.0


def test_bench_train_profiles_a_step_in_the_dtype_asked(gearshift_model, capsys):
    from gearshift.cli import main

    assert main(["bench", "train", "--backends", "torch", "--model", gearshift_model, "--batch-size", "4",
                 "--seq-len", "16", "--steps", "1", "--dtype", "bfloat16", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "operators (own CPU time) with the most time" in out  # no CUDA here: the CPU's operators
    assert "profiled_s" in out and " bfloat16 " in out


def test_bench_train_reports_the_model_flops_of_a_step_over_its_time(gearshift_model, monkeypatch):
    from gearshift.bench.train import measure_train, train_batch
    from gearshift.flops import PEAK_ENV, ModelFlops

    monkeypatch.setenv(PEAK_ENV, "2")
    row, = measure_train(["torch"], gearshift_model, batch_size=4, seq_len=16, min_len=6, steps=1)
    flops = ModelFlops.of_model(gearshift_model).train(train_batch(4, 16, 6).lengths.tolist())
    assert row["train_tflops"] == pytest.approx(flops / row["seconds_per_step"] / 1e12, rel=1e-9)
    assert row["mfu"] == pytest.approx(row["train_tflops"] / 2, rel=1e-9)
