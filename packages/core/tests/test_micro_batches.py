"""Token-budget micro-batches: packing by length, and a packed step equal to one whole-batch step."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.micro_batch import even_out, micro_batch_rows, select_micro_batches, sum_metrics
from gearshift.rl.algos import TOKENS_PER_SEQ, make_policy_loss_fn, make_value_loss_fn, tokens_per_seq
from gearshift.train import TrainBatch


def batch_of_lengths(prompt_lens, response_lens, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(32, 120, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(32, 120, (n,), generator=g).tolist() for n in response_lens]
    return TrainBatch.from_sequences(prompts, responses)


def test_rows_are_packed_longest_first_within_the_budget():
    batch = batch_of_lengths([2, 1, 3, 1, 2, 3], [3, 1, 4, 2, 1, 3])  # lengths 5, 2, 7, 3, 3, 6
    # sorted: 7 (row 2), 6 (5), 5 (0), 3 (3), 3 (4), 2 (1); a group holds while rows x its first row's
    # length <= 12: [7] (7 + 6 would be 2 x 7 = 14), [6, 5] (12), [3, 3, 2] (9)
    groups = [g.tolist() for g in batch.packed_rows(12)]
    assert groups == [[2], [5, 0], [3, 4, 1]]
    assert [g.tolist() for g in batch.packed_rows(12, max_rows=2)] == [[2], [5, 0], [3, 4], [1]]
    assert [g.tolist() for g in batch.packed_rows(4)] == [[2], [5], [0], [3], [4], [1]]  # too long: alone
    packed = batch.select(torch.tensor([3, 4, 1])).trimmed()
    assert packed.width == 3 and packed.loss_mask.shape == (3, 3)  # the batch is 7 wide; these rows, 3
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        batch.packed_rows(0)


def test_micro_batching_is_pure_rows_then_count_then_cut():
    batch = batch_of_lengths([2, 1, 3, 1, 2, 3], [3, 1, 4, 2, 1, 3])  # lengths 5, 2, 7, 3, 3, 6; width 7
    assert [g.tolist() for g in micro_batch_rows(batch)] == [[0, 1, 2, 3, 4, 5]]
    assert [g.tolist() for g in micro_batch_rows(batch, max_rows=4)] == [[0, 1, 2, 3], [4, 5]]
    assert [g.tolist() for g in micro_batch_rows(batch, max_tokens=12)] == [[2], [5, 0], [3, 4, 1]]
    # another rank runs 5: the largest group splits while one has two rows, first the earliest
    groups = even_out(micro_batch_rows(batch, max_rows=4), 5)
    assert [g.tolist() for g in groups] == [[0], [1], [2], [3], [4, 5]]
    # 7: every row alone, then a filler
    groups = even_out(micro_batch_rows(batch, max_rows=4), 7)
    assert [None if g is None else g.tolist() for g in groups] == [[0], [1], [2], [3], [4], [5], None]
    cut = select_micro_batches(batch, groups)
    assert [mb.size for mb, _ in cut] == [1] * 7 and all(mb.width == 7 for mb, _ in cut)
    assert cut[-1][1] is None and torch.equal(cut[-1][0].input_ids, batch.input_ids[:1])  # a filler: row 0
    assert [mb.size for mb, _ in select_micro_batches(batch, micro_batch_rows(batch, max_rows=4))] == [4, 2]
    packed = select_micro_batches(batch, micro_batch_rows(batch, max_tokens=12), trim=True)
    assert [mb.width for mb, _ in packed] == [7, 6, 3]  # each as wide as its longest row
    assert torch.equal(packed[1][0].input_ids, batch.input_ids[[5, 0], :6])


def rl_batch(seed=0) -> TrainBatch:
    """Rows of very different lengths, with what the policy and value losses read."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, 8, (12,), generator=g).tolist()
    response_lens = torch.randint(1, 24, (12,), generator=g).tolist()
    batch = batch_of_lengths(prompt_lens, response_lens, seed)
    shape = batch.loss_mask.shape
    batch.extras.update(advantages=torch.randn(shape, generator=g) * batch.loss_mask,
                        old_logprobs=-torch.rand(shape, generator=g) * batch.loss_mask,
                        old_values=torch.zeros(shape), returns=torch.rand(shape, generator=g) * batch.loss_mask)
    batch.extras[TOKENS_PER_SEQ] = tokens_per_seq(batch.loss_mask)
    return batch


def step(model, loss_fn, batch, **args):
    engine = TorchTrainEngine.build(model, lr=1e-3, max_grad_norm=None, keep_grads=True, **args)
    metrics = engine.train_step(batch, loss_fn)
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    return metrics, grads


@pytest.mark.parametrize("critic", [False, True], ids=["policy", "critic"])
def test_a_packed_step_equals_the_whole_batch_step(gearshift_model, critic):
    batch = rl_batch()
    extra = {"value_head": True} if critic else {}
    loss_fn = make_value_loss_fn() if critic else make_policy_loss_fn("ppo_clip")
    whole, whole_grads = step(gearshift_model, loss_fn, batch, **extra)
    packed, packed_grads = step(gearshift_model, loss_fn, batch, max_tokens_per_micro_batch=64, **extra)
    fixed, fixed_grads = step(gearshift_model, loss_fn, batch, micro_batch_size=5, **extra)
    assert whole["micro_batches"] == 1 and packed["micro_batches"] >= 4 and fixed["micro_batches"] == 3
    assert packed["pad_frac"] < fixed["pad_frac"] == whole["pad_frac"]  # fixed micro-batches keep the batch's width
    for other, grads in ((packed, packed_grads), (fixed, fixed_grads)):
        assert other["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
        assert other["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
        for name, g in whole_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_packed_forward_returns_rows_in_their_order(gearshift_model):
    batch = rl_batch(seed=1)
    whole = TorchTrainEngine.build(gearshift_model).forward_logprobs(batch, with_entropy=True)
    packed = TorchTrainEngine.build(gearshift_model, max_tokens_per_micro_batch=40).forward_logprobs(
        batch, with_entropy=True)
    attended = batch.attention_mask.bool()
    assert packed.logprobs.shape == batch.input_ids.shape
    torch.testing.assert_close(packed.logprobs[attended], whole.logprobs[attended], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.entropy[attended], whole.entropy[attended], rtol=1e-5, atol=1e-5)


# Two ranks with different rows: packed by length, rank 0 makes several micro-batches and rank 1 fewer
# (one row), so without agreement FSDP's collectives in each forward and backward would wait forever.
TWO_RANKS = textwrap.dedent("""
    import os, torch
    import torch.distributed as dist
    from gearshift import dist as gdist
    from gearshift import shared_prefix
    from gearshift_fsdp.engine import FSDPTrainEngine
    from gearshift.rl.algos import TOKENS_PER_SEQ, make_policy_loss_fn, tokens_per_seq
    from gearshift.train import TrainBatch

    gdist.init()
    rank = gdist.rank()
    g = torch.Generator().manual_seed(rank)
    n = 7 if rank == 0 else 1
    shared = [torch.randint(32, 120, (3,), generator=g).tolist() for _ in range(3)]  # rank 0: 3 prompts, 7 rows
    prompts = [shared[i % 3] for i in range(n)]
    responses = [torch.randint(32, 120, (int(k),), generator=g).tolist() for k in torch.randint(1, 20, (n,), generator=g)]
    batch = TrainBatch.from_sequences(prompts, responses)
    batch.extras.update(advantages=torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask,
                        old_logprobs=-torch.rand(batch.loss_mask.shape, generator=g) * batch.loss_mask)
    batch.extras[TOKENS_PER_SEQ] = tokens_per_seq(batch.loss_mask)
    loss_fn = make_policy_loss_fn("ppo_clip")
    results = {}
    for name, args in (("whole", {}), ("packed", {"max_tokens_per_micro_batch": 30}),
                       ("apart", {"max_tokens_per_micro_batch": 30, "share_prompts": False})):
        engine = FSDPTrainEngine.build(os.environ["MODEL"], lr=1e-3, max_grad_norm=None, param_dtype="float32",
                                       keep_grads=True, **args)
        metrics = engine.train_step(batch, loss_fn)
        grads = [p.grad.to_local().clone() for p in engine.model.parameters()]
        results[name] = (metrics, grads)
    whole, whole_grads = results["whole"]
    packed = results["packed"][0]
    plans = [None, None]
    dist.all_gather_object(plans, len(shared_prefix.packed_micro_batches(batch, 30)))
    assert whole["micro_batches"] == 1 and packed["micro_batches"] == max(plans) and plans[0] != plans[1], plans
    assert whole["shared_frac"] > 0 and results["apart"][0]["shared_frac"] == 0  # rank 0's prompts computed once
    for other, grads in (results["packed"], results["apart"]):
        assert abs(other["loss"] - whole["loss"]) <= 1e-5 * abs(whole["loss"]) + 1e-7, (other, whole)
        for a, b in zip(grads, whole_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    print(f"rank {rank}: OK {int(packed['micro_batches'])} micro-batches, own plan {plans[rank]}")
""")


def test_every_rank_runs_as_many_micro_batches_under_fsdp(gearshift_model, tmp_path):
    pytest.importorskip("gearshift_fsdp")
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARSHIFT_DIST_TIMEOUT": "120", "MODEL": gearshift_model}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "rank 0: OK" in out and "rank 1: OK" in out, out[-3000:]
    assert "own plan 1" in out  # rank 1 alone would have run one micro-batch


def test_a_micro_batchs_metrics_are_read_once_for_the_whole_step(gearshift_model, monkeypatch):
    """Each loss metric stays a tensor until the step's end: reading one to the host in the loop would make
    every micro-batch wait on the device before its backward is queued."""
    batch = rl_batch()
    loss_fn = make_policy_loss_fn("ppo_clip", entropy_coef=0.01)
    _, metrics = loss_fn(TorchTrainEngine.build(gearshift_model).forward_logprobs(batch, with_entropy=True), batch)
    assert all(isinstance(metrics[k], torch.Tensor) for k in ("pg_loss", "entropy", "clip_frac"))

    reads = []
    for name in ("__float__", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, **k: reads.append(1) or _real(t, *a, **k))

    def count(**args):
        reads.clear()
        metrics, _ = step(gearshift_model, loss_fn, batch, **args)
        return len(reads), metrics["micro_batches"]

    whole, packed = count(), count(max_tokens_per_micro_batch=48)
    assert packed[1] >= 4 * whole[1]
    assert packed[0] == whole[0], f"{whole[0]} reads with one micro-batch, {packed[0]} with {packed[1]:.0f}"


def test_metrics_of_micro_batches_sum_by_weight_and_maxima_skip_fillers():
    seen = [("loss", torch.tensor(2.0), 0.25, True), ("ratio_max", torch.tensor(3.0), 0.25, True),
            ("loss", 4.0, 0.75, True), ("ratio_max", torch.tensor(9.0), 0.0, False)]
    assert sum_metrics(seen) == {"loss": 3.5, "ratio_max": 3.0}
    assert sum_metrics([("x_max", torch.tensor(1.0), 0.0, False)]) == {"x_max": 0.0}  # fillers only
    assert sum_metrics([]) == {}
