"""Shared prompts: a prompt's rows packed into one sequence give the rows' own log-probabilities and gradients."""

import warnings

import pytest
import torch

from gearshift import shared_prefix
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.rl.algos import TOKENS_PER_SEQ, make_policy_loss_fn, tokens_per_seq
from gearshift.train import TrainBatch


def grpo_batch(prompts=4, n=4, seed=0) -> TrainBatch:
    """`prompts` prompts of 3-9 tokens, `n` answers of 1-11 tokens each, what GRPO's loss reads; the last row
    an episode whose middle tokens (a tool's answer) carry no loss."""
    g = torch.Generator().manual_seed(seed)
    rows_p, rows_r = [], []
    for _ in range(prompts):
        p = torch.randint(32, 120, (int(torch.randint(3, 10, (), generator=g)),), generator=g).tolist()
        for _ in range(n):
            rows_p.append(p)
            rows_r.append(torch.randint(32, 120, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist())
    rows_r[-1] = rows_r[-1] + [40, 41, 42, 43, 44, 45]
    batch = TrainBatch.from_sequences(rows_p, rows_r)
    last = len(rows_p[-1]) + len(rows_r[-1])
    batch.loss_mask[-1, last - 5:last - 2] = 0  # the tool's tokens
    shape = batch.loss_mask.shape
    batch.extras.update(advantages=torch.randn(shape, generator=g) * batch.loss_mask,
                        old_logprobs=-torch.rand(shape, generator=g) * batch.loss_mask)
    batch.extras[TOKENS_PER_SEQ] = tokens_per_seq(batch.loss_mask)
    return batch


def test_a_layout_puts_each_prompt_once_and_each_rows_tokens_after_it():
    batch = TrainBatch.from_sequences([[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7]], [[10, 11], [12], [13, 14], [15]])
    lay = shared_prefix.layout(batch)
    # prompts [5, 6, 7] (rows 0, 1, 3) and [8, 9] (row 2): two sequences; the first 3 + 2 + 1 + 1 = 7 wide
    assert lay.input_ids.shape == (2, 7) and lay.computed == 14 and lay.real == 7 + 4
    assert lay.input_ids[0].tolist() == [5, 6, 7, 10, 11, 12, 15]  # longest row first
    assert lay.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 3]  # each row's positions go on from the prompt
    assert lay.segments[0].tolist() == [0, 0, 0, 1, 1, 2, 3] and lay.segments[1].tolist() == [0, 0, 1, 1, -1, -1, -1]
    flat = lay.input_ids.flatten()
    for r in range(batch.size):  # every row's tokens are where its index says
        n = int(batch.lengths[r])
        assert flat[lay.index[r, :n]].tolist() == batch.input_ids[r, :n].tolist()
    seen = lay.attention_mask("bool")[0, 0]
    assert seen[5].tolist() == [True, True, True, False, False, True, False]  # row 1's answer: prompt and itself
    assert seen[4].tolist() == [True] * 5 + [False] * 2
    additive = lay.attention_mask("additive")[0, 0]
    assert additive[5, 3] == torch.finfo(torch.float32).min and additive[5, 2] == 0
    assert shared_prefix.layout(batch, cap=5).input_ids.shape == (3, 5)  # a cap of 5: the first prompt in two


def test_rows_share_nothing_without_a_prompt_before_their_first_trained_token():
    batch = TrainBatch.from_sequences([[5, 6], [5, 6], [5, 6]], [[7], [8], [9]])
    batch.loss_mask[2] = 0  # nothing trained: no prompt of its own
    assert shared_prefix.prompt_lengths(batch) == [2, 2, 0]
    assert shared_prefix.prompt_groups(batch) == [[0, 1], [2]]
    left = TrainBatch(torch.tensor([[0, 5, 6, 7]]), torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0., 0, 0, 1]]))
    assert shared_prefix.prompt_lengths(left) == [0]  # left padding: not shared


def test_micro_batches_keep_a_prompts_rows_together_within_the_budget():
    batch = grpo_batch(prompts=6, n=4)
    lengths = batch.lengths.tolist()
    prompts = shared_prefix.prompt_lengths(batch)
    for budget in (16, 40, 100, 1000):
        groups = [g.tolist() for g in shared_prefix.packed_micro_batches(batch, budget)]
        assert sorted(r for g in groups for r in g) == list(range(batch.size))
        for rows in groups:
            lay = shared_prefix.layout(batch.select(torch.tensor(rows)).trimmed(), cap=budget)
            widths = [shared_prefix.packed_width(list(range(len(rows))), 0, lengths)]
            assert lay.computed <= budget or lay.input_ids.shape[0] == 1, (budget, rows, widths)
        if budget >= 100:  # every prompt's 4 rows fit in one sequence: no prompt is split
            owners = [{tuple(batch.input_ids[r, :prompts[r]].tolist()) for r in rows} for rows in groups]
            assert sum(len(o) for o in owners) == 6
    assert len(shared_prefix.packed_micro_batches(batch, 1000)) == 1
    assert all(len(g) <= 3 for g in shared_prefix.packed_micro_batches(batch, 1000, max_rows=3))
    with pytest.raises(ValueError, match="max_tokens=0"):
        shared_prefix.packed_micro_batches(batch, 0)


def engine(model, **args):
    return TorchTrainEngine.build(model, lr=1e-3, max_grad_norm=None, keep_grads=True, **args)


def test_shared_prompts_give_every_rows_logprobs_and_entropies(gearshift_model):
    batch = grpo_batch()
    apart = engine(gearshift_model, share_prompts=False).forward_logprobs(batch, with_entropy=True)
    shared = engine(gearshift_model, share_prompts=True)
    out = shared.forward_logprobs(batch, with_entropy=True)
    seen = batch.attention_mask.bool()
    torch.testing.assert_close(out.logprobs[seen], apart.logprobs[seen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy[seen], apart.entropy[seen], rtol=1e-5, atol=1e-5)
    assert shared.prompt_sharing.holds is True  # checked on its first forward


@pytest.mark.parametrize("micro", [{}, {"max_tokens_per_micro_batch": 48}, {"micro_batch_size": 6}],
                         ids=["whole", "packed", "rows"])
def test_a_step_with_shared_prompts_equals_one_without(gearshift_model, micro):
    batch = grpo_batch()
    loss_fn = make_policy_loss_fn("ppo_clip")
    apart = engine(gearshift_model, share_prompts=False, **micro)
    shared = engine(gearshift_model, share_prompts=True, **micro)
    m_apart, m_shared = apart.train_step(batch, loss_fn), shared.train_step(batch, loss_fn)
    assert m_apart["shared_frac"] == 0 and m_shared["shared_frac"] > 0.2
    assert m_shared["loss"] == pytest.approx(m_apart["loss"], rel=1e-5, abs=1e-7)
    assert m_shared["grad_norm"] == pytest.approx(m_apart["grad_norm"], rel=1e-4)
    assert m_shared["entropy"] == pytest.approx(m_apart["entropy"], rel=1e-5)
    grads = dict(apart.model.named_parameters())
    for name, p in shared.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_cpu_shares_prompts_by_default_and_a_gpu_only_when_asked(gearshift_model):
    e = engine(gearshift_model)
    assert e.args.share_prompts is None and e.shares_prompts()
    e.device = torch.device("cuda")  # no GPU needed: the choice reads the device
    assert not e.shares_prompts()
    assert engine(gearshift_model, share_prompts=False).shares_prompts() is False


def _sharing_turns_off(model, hook, warned: str, refused: str) -> None:
    """An engine whose model runs under `hook` trains its rows apart, with a warning matching `warned`, to the
    loss of an engine that never shares; asked to share, it fails with an error matching `refused`."""
    batch = grpo_batch()
    loss_fn = make_policy_loss_fn("ppo_clip")
    apart = engine(model, share_prompts=False).train_step(batch, loss_fn)
    auto = engine(model)
    auto.model.register_forward_pre_hook(hook, with_kwargs=True)
    with pytest.warns(UserWarning, match=warned):
        metrics = auto.train_step(batch, loss_fn)
    assert auto.prompt_sharing.holds is False and not auto.shares_prompts()
    assert metrics["shared_frac"] == 0 and metrics["loss"] == pytest.approx(apart["loss"], rel=1e-5)
    asked = engine(model, share_prompts=True)
    asked.model.register_forward_pre_hook(hook, with_kwargs=True)
    with pytest.raises(ValueError, match=refused):
        asked.train_step(batch, loss_fn)


def test_a_model_that_ignores_the_mask_turns_sharing_off_or_fails_when_asked(gearshift_model):
    def own_mask(module, args, kwargs):  # a model that makes its own causal mask whatever it is given
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() == 4:
            kwargs["attention_mask"] = None
        return args, kwargs

    _sharing_turns_off(gearshift_model, own_mask, "shared prompts turned off: .*differ by",
                       "does not take the packed rows' attention mask.*share_prompts=false")
    with warnings.catch_warnings():  # the hook gone, a fresh engine checks and shares
        warnings.simplefilter("error")
        fresh = engine(gearshift_model)
        assert fresh.train_step(grpo_batch(), make_policy_loss_fn("ppo_clip"))["shared_frac"] > 0.2


def test_a_model_whose_forward_refuses_a_4d_mask_trains_its_rows_apart(gearshift_model, tmp_path):
    """Bloom reads the attention mask as [batch, length] and fails on the packed rows' 4-D one."""
    from gearshift.models import resolve_model

    def refuse(module, args, kwargs):
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() == 4:
            raise ValueError("too many values to unpack (expected 2)")
        return args, kwargs

    _sharing_turns_off(gearshift_model, refuse, "shared prompts turned off: the model's forward refused the packed "
                                                "rows' 4-D attention mask \\(ValueError: too many values",
                       "refused the packed rows' 4-D attention mask.*share_prompts=false")
    bloom = engine(resolve_model("tiny-bloom", cache_dir=tmp_path))  # the architecture itself
    with pytest.warns(UserWarning, match="refused the packed rows' 4-D attention mask"):
        assert bloom.train_step(grpo_batch(), make_policy_loss_fn("ppo_clip"))["shared_frac"] == 0


def test_asking_for_shared_prompts_where_they_cannot_run_fails_at_build(gearshift_model, monkeypatch):
    with pytest.raises(ValueError, match="share_prompts=true, but a critic's values"):
        engine(gearshift_model, share_prompts=True, value_head=True)
    assert not engine(gearshift_model, value_head=True).shares_prompts()  # by default: off, quietly
    e = engine(gearshift_model)
    monkeypatch.setattr(e.hf_model.config, "_attn_implementation", "flash_attention_2")
    assert "takes no 4-D mask" in e.prompt_sharing.refused() and not e.shares_prompts()
    e = engine(gearshift_model)
    assert e.shares_prompts()
    monkeypatch.setattr(e.hf_model.config, "sliding_window", 512, raising=False)
    monkeypatch.setattr(e.hf_model.config, "layer_types", ["sliding_attention", "full_attention"], raising=False)
    assert "sliding window of 512 tokens" in e.prompt_sharing.refused() and not e.shares_prompts()


def test_a_sliding_window_is_found_in_every_way_a_config_gives_it():
    from types import SimpleNamespace as C

    assert shared_prefix.sliding_window(C(sliding_window=None)) is None
    assert shared_prefix.sliding_window(C(sliding_window=4096)) == 4096  # Mistral's: every layer
    assert shared_prefix.sliding_window(C(sliding_window=4096, use_sliding_window=False)) is None  # Qwen2's switch
    assert shared_prefix.sliding_window(C(sliding_window=512, layer_types=["full_attention"] * 2)) is None
    assert shared_prefix.sliding_window(C(sliding_window=512, layer_types=["sliding_attention", "full_attention"])) == 512


def test_the_eager_attention_takes_an_additive_mask_and_gives_the_same_logprobs(gearshift_model):
    batch = grpo_batch(seed=2)
    apart = engine(gearshift_model, share_prompts=False).forward_logprobs(batch)
    eager = engine(gearshift_model, share_prompts=True)
    eager.hf_model.config._attn_implementation = "eager"  # read at every forward
    assert eager.prompt_sharing.mask_kind == "additive"
    out = eager.forward_logprobs(batch)
    seen = batch.attention_mask.bool()
    torch.testing.assert_close(out.logprobs[seen], apart.logprobs[seen], rtol=1e-5, atol=1e-5)


def test_left_to_itself_an_engine_shares_prompts_only_where_packing_computes_less(gearshift_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gearshift_model)
    # two prompts of 8 rows each: 40 prompt tokens then 3, and 3 then 60
    long_prompts = TrainBatch.from_sequences([[40 + k] * 40 for k in (0, 1) for _ in range(8)], [[50, 51, 52]] * 16)
    long_answers = TrainBatch.from_sequences([[40 + k, 41, 42] for k in (0, 1) for _ in range(8)],
                                             [[50 + i % 9] * 60 for i in range(16)])
    assert shared_prefix.sharing_pays(long_prompts, config)
    assert not shared_prefix.sharing_pays(long_answers, config)  # attention over ~480 packed tokens costs more
    loss_fn = make_policy_loss_fn("ppo_clip")
    for batch, shared in ((long_prompts, True), (long_answers, False)):
        shape = batch.loss_mask.shape
        batch.extras.update(advantages=torch.ones(shape) * batch.loss_mask, old_logprobs=-batch.loss_mask.float())
        batch.extras[TOKENS_PER_SEQ] = tokens_per_seq(batch.loss_mask)
        left, asked = engine(gearshift_model), engine(gearshift_model, share_prompts=True)
        assert (left.train_step(batch, loss_fn)["shared_frac"] > 0) is shared
        assert asked.train_step(batch, loss_fn)["shared_frac"] > 0  # asked for, it shares regardless
