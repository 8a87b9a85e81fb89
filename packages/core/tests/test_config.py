import re

import pytest

from gearshift.rl.config import Config, ConfigError, build_config, load_config


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algorithm:\n  name: ppo\nrollout:\n  n: 4\n  options: {max_batch_size: 8}\n")
    cfg = load_config(f, ["rollout.n=6", "train.lr=1e-3", "rollout.options.seed=1", "rollout.stop=[\"\\n\", '.']"])
    assert cfg.algorithm.name == "ppo" and cfg.rollout.n == 6 and cfg.train.lr == 1e-3
    assert cfg.rollout.options == {"max_batch_size": 8, "seed": 1}
    assert cfg.rollout.stop == ["\n", "."]
    assert isinstance(cfg.train.lr, float) and isinstance(cfg, Config)


def test_values_interpolate_other_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  output_dir: runs/${algorithm.name}-${run.seed}\n")
    assert load_config(f, ["algorithm.name=ppo", "run.seed=3"]).run.output_dir == "runs/ppo-3"


def test_unknown_keys_and_wrong_types_name_the_key_and_where_it_came_from(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'train.lrr=1': unknown key 'lrr' in train; known: \[.*'lr'"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"override 'rollout.n=many': rollout.n: .*'many'"):
        load_config(None, ["rollout.n=many"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.yaml")
    f = tmp_path / "typo.yaml"
    f.write_text("run:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=rf"{f}: unknown key 'stepz' in run"):
        load_config(f)


def test_malformed_yaml_names_file_line_and_column(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("run:\n  steps: 3\n  seed: [1, 2\nmodel: {}\n")
    with pytest.raises(ConfigError, match=rf"{f}:\d+:\d+: not valid YAML"):
        load_config(f)
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"override 'rollout.stop=\[1, 2': the value is not valid YAML"):
        load_config(None, ["rollout.stop=[1, 2"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["nonsense"])


def test_the_cli_exits_2_on_a_malformed_file_and_names_it(tmp_path, capsys):
    from gearshift.cli import main

    f = tmp_path / "bad.yaml"
    f.write_text("run: {steps: 3\n")
    assert main(["train", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}:" in err and "not valid YAML" in err and "Traceback" not in err


def test_validation_lists_what_to_change():
    cfg = load_config(None, ["run.prompts_per_step=3", "rollout.n=4", "train.mini_batch_size=5",
                             "train.mesh=dp=4", "algorithm.name=grpo", "rollout.top_p=2", "switch.offload=gradz"])
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=2)
    text = str(err.value)
    assert "mini_batch_size=5 does not divide the batch" in text
    assert "must be a multiple of rollout.n=4" in text
    assert "prompts_per_step=3 must divide evenly over 2 ranks" in text
    assert "train.mesh" in text and "world has 2" in text
    assert "top_p=2.0 must be in (0, 1]" in text  # sampling is checked before any engine is built
    assert "unknown tags ['gradz']" in text


def test_rl_feature_keys_are_checked():
    cfg = load_config(None, ["algorithm.rollout_correction_cap=0.5", "train.max_tokens_per_micro_batch=-1",
                             "algorithm.critic_warmup=-2", "algorithm.critic_epochs=-1"])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    text = str(err.value)
    assert "algorithm.rollout_correction_cap=0.5 must be >= 1" in text
    assert "train.max_tokens_per_micro_batch=-1 must be >= 1 (or null: off)" in text
    assert "algorithm.critic_warmup=-2 must be >= 0" in text
    assert "algorithm.critic_epochs=-1 must be >= 1" in text
    ok = load_config(None, ["algorithm.rollout_correction=mis", "algorithm.rollout_correction_level=geometric",
                            "rollout.dtype=bfloat16", "train.max_tokens_per_micro_batch=4096"]).validate()
    assert ok.algorithm.rollout_correction_cap == 2.0


#: a choice key, a value it does not take, and the message that says which it takes
BAD_CHOICES = [
    ("algorithm.name", "dpo", "use grpo or ppo"),
    ("algorithm.kl_in", "both", "use loss or reward"),
    ("algorithm.loss_agg", "sum", "use one of token_mean, seq_mean_token_sum, seq_mean_token_mean"),
    ("algorithm.gae_norm", "whiten", "use one of center_scale, scale, none"),
    ("algorithm.rollout_correction", "is", "use one of none, tis, mis"),
    ("algorithm.rollout_correction_level", "seq", "use one of token, sequence, geometric"),
    ("algorithm.old_logprobs", "never", "use auto or recompute"),
    ("model.dtype", "bf16", "use one of bfloat16, float16, float32"),
    ("model.lora.sync", "both", "use merged or adapter"),
    ("rollout.dtype", "bf16", "use one of bfloat16, float16, float32"),
    ("rollout.logprobs", "often", "use one of auto, always, never"),
    ("switch.share", "maybe", "use one of auto, on, off"),
    ("run.placement", "ray", "use colocated or split"),
    ("run.pools.reference", "driver", "use train or rollout"),
    ("run.pools.reward_model", "driver", "use rollout or train"),
    ("run.pools.device", "tpu", "use one of auto, cpu, gpu"),
]


@pytest.mark.parametrize("key,value,allowed", BAD_CHOICES, ids=[c[0] for c in BAD_CHOICES])
def test_a_choice_key_takes_only_its_values_from_a_file_an_override_or_python(key, value, allowed, tmp_path):
    with pytest.raises(ConfigError, match=rf"^override '{key}={value}': {key}='{value}': {allowed}$"):
        load_config(None, [f"{key}={value}"])
    *sections, name = key.split(".")
    f = tmp_path / "c.yaml"
    lines = [f"{'  ' * i}{section}:" for i, section in enumerate(sections)]
    f.write_text("\n".join([*lines, f"{'  ' * len(sections)}{name}: {value}", ""]))
    with pytest.raises(ConfigError, match=rf"^{f}: {key}='{value}': {allowed}$"):
        load_config(f)
    nested = value
    for part in reversed(key.split(".")[1:]):
        nested = {part: nested}
    with pytest.raises(ConfigError, match=rf"^the sections given: {key}='{value}': {allowed}$"):
        build_config(None, {sections[0]: nested})


def test_choice_keys_are_plain_strings_and_agree_with_what_reads_them():
    import typing

    from gearshift.options import DTYPES
    from gearshift.rl.algos import AGGREGATIONS, CORRECTION_LEVELS, CORRECTIONS
    from gearshift.rl.config import GAE_NORMS, AlgorithmConfig, RolloutConfig

    cfg = load_config(None, ["algorithm.name=ppo", "switch.share=off"])
    assert cfg.algorithm.name == "ppo" and type(cfg.algorithm.name) is str and cfg.switch.share == "off"
    hints = typing.get_type_hints(AlgorithmConfig)
    assert typing.get_args(hints["rollout_correction"]) == CORRECTIONS
    assert typing.get_args(hints["rollout_correction_level"]) == CORRECTION_LEVELS
    assert typing.get_args(hints["loss_agg"]) == AGGREGATIONS
    assert typing.get_args(hints["gae_norm"]) == tuple(GAE_NORMS)
    dtype = typing.get_args(typing.get_type_hints(RolloutConfig)["dtype"])[0]
    assert set(typing.get_args(dtype)) == set(DTYPES)


def test_older_spellings_of_unset_read_as_null(tmp_path):
    from gearshift.rl.engines import train_options

    f = tmp_path / "old.yaml"
    f.write_text("train:\n  lr: 0\n  mini_batch_size: 0\n  micro_batch_size: 0\n  max_tokens_per_micro_batch: 0\n"
                 "  mesh: ''\nrollout:\n  dtype: ''\n  mesh: ''\nalgorithm:\n  advantage: ''\n"
                 "  critic_epochs: 0\nrun:\n  ray_address: ''\ndata:\n  path: ''\n")
    cfg = load_config(f).validate()
    t, r = cfg.train, cfg.rollout
    assert (t.lr, t.mini_batch_size, t.micro_batch_size, t.max_tokens_per_micro_batch, t.mesh) == (None,) * 5
    assert (r.dtype, r.mesh, cfg.algorithm.advantage, cfg.algorithm.critic_epochs, cfg.run.ray_address,
            cfg.data.path) == (None,) * 6
    assert cfg == Config() and load_config(None, ["train.lr=0", "rollout.dtype="]) == Config()
    assert build_config(None, {"train": {"micro_batch_size": 0}}).train.micro_batch_size is None
    options = train_options(cfg, "model")  # passed straight through: None is what every engine takes as unset
    assert options["mesh"] is None and options["micro_batch_size"] is None and options["lr"] == 3e-4
    assert cfg.rollout_dtype() == "float32" and cfg.algorithm.estimator() == "grpo"
    # 0 stays a value where it is one
    kept = load_config(None, ["model.lora.r=0", "run.checkpoint_every=0", "rollout.top_k=0"])
    assert (kept.model.lora.r, kept.run.checkpoint_every, kept.rollout.top_k) == (0, 0, 0)


def test_each_section_checks_itself_and_the_config_adds_the_rules_across_them():
    from gearshift.rl.config import LoraConfig, PoolsConfig, TrainConfig

    assert TrainConfig(lr=-1.0).problems("train.") == ["train.lr=-1.0 must be > 0 (or null: the algorithm's own)"]
    assert LoraConfig(r=-1).all_problems("model.lora.") == ["model.lora.r=-1 must be >= 0 (0: no LoRA)"]
    assert PoolsConfig(train=0).problems("run.pools.") == ["run.pools.train=0 must be >= 1"]
    cfg = build_config(None, {"model": {"lora": {"r": -1}}, "rollout": {"n": 1}})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert "model.lora.r=-1" in str(err.value)  # a section inside a section
    assert "rollout.n=1: GRPO compares samples" in str(err.value)  # a rule across algorithm and rollout


def test_every_key_is_documented_and_print_config_shows_it(tmp_path, capsys):
    import dataclasses

    from gearshift.cli import main
    from gearshift.rl.config import field_help

    def sections(cls):
        yield cls
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                yield from sections(f.default_factory)

    assert len(list(sections(Config))) == 12  # Config, its 9 sections, model.lora, run.pools
    for cls in sections(Config):
        missing = [f.name for f in dataclasses.fields(cls) if not field_help(cls).get(f.name)]
        assert not missing, f"{cls.__name__}: keys with no docstring: {missing}"
    assert field_help(Config) and "algorithm's own" in field_help(type(Config().train))["lr"]
    assert main(["train", "--print-config", "algorithm.name=ppo"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    at = lines.index("  lr: null")
    assert lines[at - 1].startswith("  # The policy's learning rate; null: the algorithm's own")
    assert "  name: ppo" in lines
    f = tmp_path / "printed.yaml"
    f.write_text(printed)
    assert load_config(f) == load_config(None, ["algorithm.name=ppo"])  # what it prints reads back the same


def test_prompt_and_completion_must_fit_the_context():
    with pytest.raises(ConfigError, match=r"max_prompt_len=64 \+ rollout.max_tokens=100 is more than the context of 128"):
        load_config(None, ["rollout.max_tokens=100", "rollout.max_model_len=128"]).validate()


def test_grpo_needs_groups_and_kl_in_reward_needs_token_rewards():
    with pytest.raises(ConfigError, match="n >= 2"):
        load_config(None, ["rollout.n=1"]).validate()
    with pytest.raises(ConfigError, match="kl_in=reward"):
        load_config(None, ["algorithm.kl_in=reward", "algorithm.kl_coef=0.1"]).validate()
    Config().validate()


def test_the_task_picks_its_reward_and_a_dataset_needs_one():
    assert load_config(None, ["data.task=reverse"]).reward.resolved(Config().data) == "gearshift.rl.rewards:numeric_match"
    cfg = load_config(None, ["data.task=reverse"])
    assert cfg.reward.resolved(cfg.data) == "gearshift.rl.rewards:exact_match"
    with pytest.raises(ConfigError, match="reward.fn is not set"):
        load_config(None, ["data.path=rows.jsonl"]).validate()
    load_config(None, ["data.path=rows.jsonl"]).validate(reward_given=True)


def test_python_sections_merge_like_overrides():
    cfg = build_config(None, {"run": {"steps": 7}, "rollout": {"backend": "hf"}})
    assert cfg.run.steps == 7 and cfg.rollout.backend == "hf" and cfg.train.backend == "fsdp"
    with pytest.raises(ConfigError, match="unknown key 'stepz' in run"):
        build_config(None, {"run": {"stepz": 7}})


def test_mini_batches_default_to_the_algorithms_own():
    assert load_config(None, []).mini_batches() == 1  # grpo: the whole batch in one optimizer step
    assert load_config(None, ["algorithm.name=ppo"]).mini_batches() == 2
    assert load_config(None, ["algorithm.name=ppo", "train.mini_batch_size=256"]).mini_batches() == 1
    assert load_config(None, ["train.mini_batch_size=64"]).mini_batches() == 4  # 32 prompts x 8 samples


def test_the_policy_learning_rate_defaults_to_the_algorithms_own():
    from gearshift.rl.engines import train_options

    assert load_config(None, []).policy_lr() == 3e-4
    assert load_config(None, ["algorithm.name=ppo"]).policy_lr() == 2e-4
    assert build_config(None, {"algorithm": {"name": "ppo"}}).policy_lr() == 2e-4  # Trainer(algorithm=...)
    assert load_config(None, ["algorithm.name=ppo", "train.lr=1e-5"]).policy_lr() == 1e-5
    assert train_options(load_config(None, ["algorithm.name=ppo"]), "model")["lr"] == 2e-4
    with pytest.raises(ConfigError, match="train.lr=-0.1 must be > 0"):
        load_config(None, ["train.lr=-0.1"]).validate()


def test_engine_options_may_not_restate_common_arguments():
    with pytest.raises(ConfigError) as e:
        load_config(None, ['rollout.options={"dtype": "bfloat16", "max_batch_size": 8}',
                           'train.options={"lr": 0.1, "zero_stage": 3}']).validate()
    text = str(e.value)
    assert "rollout.options.dtype: dtype is an argument of every rollout engine, set by rollout.dtype" in text
    assert "train.options.lr: lr is an argument of every train engine, set by train.lr" in text
    assert "max_batch_size" not in text and "zero_stage" not in text


def test_switch_share_on_and_off_read_as_words_not_booleans(tmp_path):
    # YAML 1.1 reads a bare on / off as true / false
    assert [load_config(None, [f"switch.share={v}"]).switch.share for v in ("on", "off", "auto")] == ["on", "off", "auto"]
    (tmp_path / "c.yaml").write_text("switch:\n  share: off\n")
    assert load_config(tmp_path / "c.yaml").switch.share == "off"
    assert build_config(None, {"switch": {"share": True}}).switch.share == "on"


def test_an_unset_model_is_the_default_jobs_or_the_tool_tasks_own():
    assert load_config(None, []).model.path == "small-add" == Config().model.path
    assert load_config(None, ["data.task=calc"]).model.path == "small-calc"
    assert build_config(None, {"data": {"task": "calc"}}).model.path == "small-calc"
    assert load_config(None, ["data.task=calc", "model.path=tiny-calc"]).model.path == "tiny-calc"
    assert load_config(None, ["data.task=reverse"]).model.path == "small-add"
    assert load_config(None, ["data.task=calc", "data.path=rows.jsonl"]).model.path == "small-add"  # not the task's


def test_the_rollouts_batch_tokens_count_every_samples_prompt_and_answer_or_its_episode():
    cfg = load_config(None, ["run.prompts_per_step=32", "rollout.n=8", "data.max_prompt_len=64",
                             "rollout.max_tokens=256"])
    assert cfg.rollout_batch_tokens() == 32 * 8 * (64 + 256)
    episodes = load_config(None, ["data.task=calc", "run.prompts_per_step=4", "rollout.n=2", "agent.max_tokens=96"])
    assert episodes.rollout_batch_tokens() == 4 * 2 * (episodes.data.max_prompt_len + 96)


def test_an_engine_option_its_backend_lacks_fails_before_anything_is_built(monkeypatch):
    from gearshift.rl import Trainer
    from gearshift.rl.engines import check_options

    check_options(load_config(None, ["rollout.backend=hf", "train.backend=torch",
                                     'rollout.options={"max_batch_size": 8}']))
    with pytest.raises(ConfigError, match="rollout.options: rollout backend 'hf': HFRolloutEngine has no option "
                                          "'max_batch_sise'.*also takes: device, max_batch_size"):
        check_options(load_config(None, ["rollout.backend=hf", 'rollout.options={"max_batch_sise": 8}']))
    with pytest.raises(ConfigError, match="train.options: train backend 'torch': .*'gradient_checkpointing' = "
                                          "'maybe'"):
        check_options(load_config(None, ["train.backend=torch", 'train.options={"gradient_checkpointing": "maybe"}']))
    # YAML reads `{name:value}` (no space) as one key; the error says so
    with pytest.raises(ConfigError, match=r"no option 'gradient_checkpointing:true' \('gradient_checkpointing:true' "
                                          r"reads as one name: write a space after the colon"):
        check_options(load_config(None, ["train.backend=torch", "train.options={gradient_checkpointing:true}"]))
    with pytest.raises(ConfigError, match=r"no option 'nothing:here'\. Every"):  # not an option's name: no hint
        check_options(load_config(None, ["train.backend=torch", "train.options={nothing:here}"]))

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built or resolved before the options were checked")

    monkeypatch.setattr("gearshift.models.resolve_model", no_build)
    monkeypatch.setattr("gearshift.registry.create", no_build)
    with pytest.raises(ConfigError, match="has no option 'max_batch_sise'"):
        Trainer(model="tiny", rollout={"backend": "hf", "options": {"max_batch_sise": 8}},
                train={"backend": "torch"}).train()


@pytest.mark.parametrize("override,message", [
    ("algorithm.kl_coef=-0.1", "kl_coef=-0.1 must be >= 0"),
    ("algorithm.entropy_coef=-0.01", "entropy_coef=-0.01 must be >= 0"),
    ("algorithm.clip_low=1.5", "clip_low=1.5 must be < 1"),
    ("algorithm.clip_high=-0.2", "clip_high=-0.2 must be >= 0"),
    ("algorithm.gamma=2", "gamma=2.0 must be within [0, 1]"),
    ("algorithm.lam=-0.5", "lam=-0.5 must be within [0, 1]"),
    ("algorithm.critic_lr=0", "critic_lr=0.0 must be > 0"),
    ("algorithm.value_clip=-1", "value_clip=-1.0 must be > 0"),
])
def test_algorithm_values_out_of_range_are_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override]).validate()


def test_algorithm_names_that_are_not_registered_fail_before_anything_is_built():
    from gearshift.rl.algos import ADVANTAGES, grpo
    from gearshift.rl.learner import check_algorithm

    check_algorithm(load_config(None, []))
    with pytest.raises(ConfigError, match=r"algorithm.advantage: unknown advantage estimator 'grp' \(did you mean "
                                          r"'grpo'\?\)"):
        check_algorithm(load_config(None, ["algorithm.advantage=grp"]))
    with pytest.raises(ConfigError, match="unknown policy loss 'ppo'"):
        check_algorithm(load_config(None, ["algorithm.policy_loss=ppo"]))
    with pytest.raises(ConfigError, match="unknown KL estimator 'k9'"):
        check_algorithm(load_config(None, ["algorithm.kl_estimator=k9", "algorithm.kl_coef=0.1"]))
    ADVANTAGES.register("my_grpo")(grpo)  # registered from Python before the run: it counts
    try:
        check_algorithm(load_config(None, ["algorithm.advantage=my_grpo"]))
    finally:
        ADVANTAGES._fns.pop("my_grpo")


def test_a_resharder_option_it_does_not_take_fails_before_anything_is_built():
    from gearshift.rl.engines import check_options

    check_options(load_config(None, ["rollout.backend=hf", "train.backend=torch"]))
    with pytest.raises(ConfigError, match="switch.options: reshard backend 'stream': .*unexpected keyword "
                                          "argument 'bucket_size'"):
        check_options(load_config(None, ["rollout.backend=hf", "train.backend=torch",
                                         'switch.options={"bucket_size": 8}']))


def test_a_model_folder_without_a_tokenizer_is_named_before_anything_is_built(gearshift_model, tmp_path):
    import shutil

    from gearshift.rl.engines import TOKENIZER_FILES, check_context

    check_context(load_config(None, []), gearshift_model)
    bare = tmp_path / "bare"
    shutil.copytree(gearshift_model, bare, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    with pytest.raises(ConfigError, match="has no tokenizer .*copy the model's tokenizer files"):
        check_context(load_config(None, []), str(bare))  # transformers would make one that yields no tokens


def test_the_rollout_asks_for_logprobs_on_the_steps_that_read_them():
    from gearshift.rl.config import MISMATCH_EVERY

    auto = Config()
    assert [s for s in range(25) if auto.sampling(seed=0, step=s).logprobs] == [0, MISMATCH_EVERY, 2 * MISMATCH_EVERY]
    assert not auto.sampling(seed=0).logprobs  # no step: an evaluation's rollout
    corrected = load_config(None, ["algorithm.rollout_correction=tis"])
    assert all(corrected.sampling(step=s).logprobs for s in range(12))
    assert all(load_config(None, ["rollout.logprobs=always"]).sampling(step=s).logprobs for s in range(12))
    assert not any(load_config(None, ["rollout.logprobs=never"]).sampling(step=s).logprobs for s in range(12))
    with pytest.raises(ConfigError, match="rollout.logprobs=never leaves out: set rollout.logprobs=auto"):
        load_config(None, ["rollout.logprobs=never", "algorithm.rollout_correction=mis"]).validate()
