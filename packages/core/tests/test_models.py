

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


def test_a_registered_task_names_models_of_every_preset(tmp_path, monkeypatch):
    """`register_task_models` is all `gearshift.models` knows of a task: its two builders, called with the
    folder and the preset a name asks for."""
    import pytest

    from gearshift import models

    monkeypatch.setattr(models, "TASK_MODELS", dict(models.TASK_MODELS))
    built = []

    def policy(folder, preset):
        built.append(("policy", folder.parent, preset))
        return models.build_model(folder, preset=preset, seed=7)

    def reward(folder, preset):
        built.append(("reward", folder.parent, preset))
        return models.build_reward_model(folder, preset)

    assert not models.known_model("tiny-echo")
    models.register_task_models("echo", policy, reward)
    assert models.known_model("tiny-echo") and models.known_model("small-echo-rm")
    path = models.resolve_model("tiny-echo", tmp_path)
    assert models.resolve_model("tiny-echo-rm", tmp_path) != path
    assert built == [("policy", tmp_path / "models", "tiny"), ("reward", tmp_path / "models", "tiny")]
    assert "'echo'" in models.unknown_model("tiny-nosuch")
    for bad in ("rm", "gpt2", "two-parts", ""):
        with pytest.raises(ValueError, match="ambiguous"):
            models.register_task_models(bad, policy, reward)


def test_a_trained_reward_model_must_say_what_its_training_depends_on(tmp_path):
    """The recipe stamp is what tells a folder to reuse from one to build again: a fit without one would be
    taken for the random model, and a recipe key of the model's own would hide it."""
    import pytest

    from gearshift.models import build_reward_model

    def fit(model, tokenizer):
        raise AssertionError("not reached")

    with pytest.raises(ValueError, match="together"):
        build_reward_model(tmp_path / "a", "tiny", train=fit)
    with pytest.raises(ValueError, match="together"):
        build_reward_model(tmp_path / "b", "tiny", recipe={"data": "x"})
    with pytest.raises(ValueError, match=r"\['seed'\]"):
        build_reward_model(tmp_path / "c", "tiny", train=fit, recipe={"seed": 1})
