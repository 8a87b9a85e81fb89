"""Multi-turn episodes: tools, their format, environments and the episode loop over a real rollout engine."""

import time

import pytest
import torch

from gearshift.rl.agent import Agent, AgentConfig, AgentError, Environment, load_tool
from gearshift.rl.agent.builtin import GuessNumber, calc
from gearshift.rl.agent.formats import ChatFormat, TextFormat, make_format, template_renders_tools
from gearshift.rl.agent.tools import ToolError, load_tools
from gearshift.rollout import Rollout, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(gearshift_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gearshift_model)


@pytest.fixture(scope="module")
def engine(gearshift_model):
    from gearshift.backends.hf_rollout import HFRolloutEngine

    return HFRolloutEngine.build(gearshift_model)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    More text."""
    return a + b


def slow(x: str) -> str:
    time.sleep(2)
    return x


def broken(x: str) -> str:
    raise KeyError("nope")


# --- tools ------------------------------------------------------------------------------------
def test_a_tools_schema_comes_from_its_signature_and_docstring():
    tool = load_tool(add)
    assert tool.schema == {"name": "add", "description": "Add two integers.",
                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                           "b": {"type": "integer"}},
                                          "required": ["a"]}}
    assert tool.call([2], {"b": 3}).text == "5"


def test_tools_load_by_module_and_by_file(tmp_path):
    assert load_tool("gearshift.rl.agent.builtin:calc").call(["12+7"]).text == "19"
    (tmp_path / "mytools.py").write_text("def shout(text: str) -> str:\n    return text.upper()\n")
    tool = load_tool(f"{tmp_path}/mytools.py:shout")
    assert tool.name == "shout" and tool.call(["hi"]).text == "HI"
    with pytest.raises(ToolError, match="has no 'whisper'.*shout"):
        load_tool(f"{tmp_path}/mytools.py:whisper")
    with pytest.raises(ToolError, match="tool 'nowhere_at_all:fn': no module"):
        load_tool("nowhere_at_all:fn")
    with pytest.raises(ToolError, match="two tools are named 'add'"):
        load_tools([add, add])


def test_a_tool_that_raises_times_out_or_gets_bad_arguments_answers_with_an_error():
    assert load_tool(broken).call(["x"]).text == "error: broken raised KeyError: 'nope'"
    result = load_tool(slow, timeout=0.1).call(["x"])
    assert result.error and "timed out after 0.1 s" in result.text
    result = load_tool(add).call([], {"c": 1})
    assert result.error and "bad arguments for add" in result.text
    assert calc("2*3-10") == "-4"
    assert "error" in load_tool(calc).call(["__import__('os')"]).text


def test_the_text_format_parses_calls_and_names_what_is_wrong():
    fmt = TextFormat(load_tools([add, calc]))
    assert sorted(fmt.stops()) == ["</calc>", "</tool>"]  # add takes two parameters: no tag of its own
    call = fmt.parse("first <tool>add(2, b=3)</tool>")
    assert (call.name, call.args, call.kwargs, call.error) == ("add", [2], {"b": 3}, None)
    assert fmt.run(call).text == "5"
    assert fmt.run(fmt.parse("<calc> 40+2 </calc>")).text == "42"
    assert fmt.parse("no call here") is None
    for text, expected in (("<tool>add(2,</tool>", "cannot read the call"),
                           ("<tool>add(x)</tool>", "must be literals"),
                           ("<tool>mul(2, 3)</tool>", "unknown tool 'mul'; tools: add, calc")):
        result = fmt.run(fmt.parse(text))
        assert result.error and expected in result.text, (text, result.text)
    assert fmt.observation(fmt.run(call), call, "") == "<result>5</result>"


HERMES = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_chat_format_takes_the_templates_json_calls_and_renders_answers_as_it_does(tokenizer):
    assert not template_renders_tools(tokenizer)  # the tiny models' template has no tools: text format
    assert isinstance(make_format("auto", load_tools([add]), tokenizer), TextFormat)
    with pytest.raises(ValueError, match="does not render tools"):
        make_format("chat", load_tools([add]), tokenizer)
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = HERMES
    fmt = make_format("auto", load_tools([add]), tok)
    assert isinstance(fmt, ChatFormat)
    call = fmt.parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>')
    assert fmt.run(call).text == "3"
    obs = fmt.observation(fmt.run(call), call, "...</tool_call><|im_end|>")
    assert obs == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert fmt.observation(fmt.run(call), call, "...</tool_call>").startswith("<|im_end|>\n<|im_start|>user")
    assert "not JSON" in fmt.run(fmt.parse("<tool_call>{name: add}</tool_call>")).text
    assert "not a JSON object" in fmt.run(fmt.parse('<tool_call>{"name": "add", "arguments": 3}</tool_call>')).text


# --- the episode loop over a scripted model ---------------------------------------------------
class Scripted:
    """A generate function that writes given turns (as a model would, one token per byte), logprob -1 each,
    and records what it was asked."""

    def __init__(self, tokenizer, turns_by_prompt):
        self.tok, self.turns, self.calls = tokenizer, turns_by_prompt, []

    def __call__(self, prompts, sampling):
        self.calls.append(([list(p) for p in prompts], sampling))
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p)
            key = next(k for k in self.turns if text.startswith(k))
            done = sum(text.count(s) for s in ("<result>", " higher ", " lower "))
            reply = self.turns[key][done]
            ids = self.tok(reply, add_special_tokens=False)["input_ids"][:sampling.max_tokens]
            stop = any(reply.endswith(s) for s in sampling.stop)
            if not stop and len(ids) < sampling.max_tokens:
                ids.append(self.tok.eos_token_id)
            reason = "stop" if (stop or ids[-1] == self.tok.eos_token_id) else "length"
            for k in range(sampling.n):
                out.append(Rollout(list(p), list(ids), [-1.0] * len(ids), reason, i, k))
        return out


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_an_episode_calls_the_tool_appends_its_answer_and_masks_it(tokenizer):
    agent = Agent(AgentConfig(tools=["gearshift.rl.agent.builtin:calc"], max_turns=3, max_tokens=40), tokenizer)
    gen = Scripted(tokenizer, {"12+7=": ["<calc>12+7</calc>", "19"], "3+4=": ["7"]})
    rows = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "3+4=", "answer": "7"}]
    prompts = [_ids(tokenizer, r["prompt"]) for r in rows]
    out = agent.run(gen, rows, prompts, SamplingParams(n=2, max_tokens=24, seed=3))
    assert [(x.prompt_index, x.sample_index) for x in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first = out[0]
    call, answer, final = _ids(tokenizer, "<calc>12+7</calc>"), _ids(tokenizer, "<result>19</result>"), \
        _ids(tokenizer, "19") + [tokenizer.eos_token_id]
    assert first.token_ids == call + answer + final
    assert first.extra["loss_mask"] == [1] * len(call) + [0] * len(answer) + [1] * len(final)
    assert first.logprobs == [-1.0] * len(call) + [0.0] * len(answer) + [-1.0] * len(final)
    assert first.text == "19" and first.finish_reason == "stop"
    assert (first.extra["turns"], first.extra["tool_calls"], first.extra["tool_errors"]) == (2, 1, 0)
    assert out[2].token_ids == _ids(tokenizer, "7") + [tokenizer.eos_token_id] and out[2].extra["turns"] == 1
    # the first turn samples n per prompt; the second continues the two live episodes from their whole
    # contexts in one batch, one sample each, ending at the tool's closing tag
    (p1, s1), (p2, s2) = gen.calls
    assert p1 == prompts and s1.n == 2 and "</calc>" in s1.stop
    assert p2 == [prompts[0] + call + answer] * 2 and s2.n == 1 and s2.seed != s1.seed


def test_episode_limits_end_it_and_a_bad_call_is_an_observation(tokenizer):
    agent = Agent(AgentConfig(tools=[calc], max_turns=2, max_tokens=160), tokenizer)
    gen = Scripted(tokenizer, {"q": ["<calc>1/0</calc>", "<calc>1+1</calc>", "2"]})
    [x] = agent.run(gen, [{"prompt": "q"}], [_ids(tokenizer, "q")], SamplingParams(n=1, max_tokens=20))
    assert x.extra["turns"] == 2 and x.extra["tool_calls"] == 1 and x.extra["tool_errors"] == 1
    assert "<result>error: " in x.extra["episode"] and x.finish_reason == "length"  # turns ran out mid-call
    # the token budget cuts an answer short and ends the episode; each turn asks for at most what is left
    agent = Agent(AgentConfig(tools=[calc], max_turns=5, max_tokens=20), tokenizer)
    gen = Scripted(tokenizer, {"q": ["<calc>11+11</calc>", "22"]})
    [x] = agent.run(gen, [{"prompt": "q"}], [_ids(tokenizer, "q")], SamplingParams(n=1, max_tokens=20))
    assert len(x.token_ids) == 20 and x.finish_reason == "length" and x.extra["turns"] == 1
    assert x.extra["loss_mask"][-1] == 0


def test_an_environment_keeps_state_owns_the_reward_and_is_picked_per_row(tokenizer):
    agent = Agent(AgentConfig(environment="gearshift.rl.agent.builtin:GuessNumber", max_turns=4, max_tokens=60),
                  tokenizer)
    gen = Scripted(tokenizer, {"g": ["5", "2", "3", "4"], "h": ["9", "8", "7", "6"]})
    rows = [{"prompt": "g", "answer": "3"}, {"prompt": "h", "answer": "1"}]
    a, b = agent.run(gen, rows, [_ids(tokenizer, "g"), _ids(tokenizer, "h")], SamplingParams(n=1, max_tokens=4))
    assert a.extra["episode"].replace("<|endoftext|>", "|") == "5| lower 2| higher 3|"
    assert a.extra["reward"] == 1.0 and a.extra["turns"] == 3 and a.text == "3"
    assert b.extra["reward"] == 0.0 and b.extra["turns"] == 4 and b.finish_reason == "length"  # never found

    class Echo(Environment):
        def reset(self, row):
            return "!"

        def step(self, text):
            return "", True, None  # no reward: the run's reward function scores the text

    rows = [{"prompt": "g", "answer": "3", "environment": Echo}, {"prompt": "h", "answer": "1"}]
    a, b = agent.run(gen, rows, [_ids(tokenizer, "g"), _ids(tokenizer, "h")], SamplingParams(n=1, max_tokens=4))
    assert "reward" not in a.extra and a.prompt_ids == _ids(tokenizer, "g!")  # reset's text follows the prompt
    assert b.extra["reward"] == 0.0


def test_an_environment_that_raises_is_an_error_naming_the_row(tokenizer):
    from gearshift.rl.data import Row

    class Broken(Environment):
        def reset(self, row):
            pass

        def step(self, text):
            raise ZeroDivisionError("boom")

    agent = Agent(AgentConfig(environment=Broken), tokenizer)
    gen = Scripted(tokenizer, {"g": ["5"]})
    with pytest.raises(AgentError, match=r"train.jsonl:7: environment Broken.step raised ZeroDivisionError: boom"):
        agent.run(gen, [Row({"prompt": "g"}, "train.jsonl:7")], [_ids(tokenizer, "g")], SamplingParams(n=1))

    class BadAnswer(Broken):
        def step(self, text):
            return "x", "maybe"

    with pytest.raises(AgentError, match="row 0: environment BadAnswer.step returned"):
        Agent(AgentConfig(environment=BadAnswer), tokenizer).run(gen, [{"prompt": "g"}], [_ids(tokenizer, "g")],
                                                                 SamplingParams(n=1))
    with pytest.raises(ToolError, match="builtin:calc' is a function, not a class"):
        Agent(AgentConfig(environment="gearshift.rl.agent.builtin:calc"), tokenizer)

    class NoStep:
        def reset(self, row):
            pass

    with pytest.raises(ToolError, match="has no step method"):
        Agent(AgentConfig(environment=NoStep), tokenizer)


# --- over a real engine ---------------------------------------------------------------------
def test_episodes_on_an_engine_carry_the_models_logprobs_of_its_own_tokens(engine, tokenizer, gearshift_model):
    """Every model token's logprob is the engine's for that token in the whole context: continuing an
    episode is generating from a prompt holding it."""
    agent = Agent(AgentConfig(environment=GuessNumber, max_turns=3, max_tokens=30), tokenizer,
                  max_model_len=engine.max_model_len)
    rows = [{"prompt": "guess 0-9:", "answer": "4"}, {"prompt": "guess 0-9:", "answer": "7"}]
    prompts = [_ids(tokenizer, r["prompt"]) for r in rows]
    out = agent.run(engine.generate, rows, prompts, SamplingParams(n=2, max_tokens=4, seed=0))
    assert len(out) == 4 and any(x.extra["turns"] > 1 for x in out)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gearshift_model, torch_dtype=torch.float32)
    for x in out:
        ids = torch.tensor([x.prompt_ids + x.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        want = logp[len(x.prompt_ids) - 1:].gather(-1, ids[0, len(x.prompt_ids):, None])[:, 0]
        mask = torch.tensor(x.extra["loss_mask"], dtype=torch.bool)
        assert (~mask).any() or x.extra["turns"] == 1
        got = torch.tensor(x.logprobs)
        assert torch.allclose(got[mask], want[mask], atol=1e-4)
        assert (got[~mask] == 0).all()


# --- the built-in tasks -----------------------------------------------------------------------
def test_the_calc_and_guess_tasks_build_with_their_tools_and_environment():
    from gearshift.rl.config import Config
    from gearshift.rl.data import PromptDataset
    from gearshift.rl.tasks import TASK_AGENTS

    cfg = Config()
    cfg.data.task = "calc"  # the default job's task_options are add's: calc takes its own
    rows = PromptDataset.from_config(cfg.data).rows
    import re

    assert all(re.fullmatch(r"\d{1,2}\+\d{1,2}=", r["prompt"]) for r in rows)
    assert max(len(r["prompt"]) for r in rows) == 6  # two-digit operands, not the default job's "a+1="
    assert all(calc(r["prompt"][:-1]) == r["answer"] for r in rows)
    assert cfg.agent.enabled("calc") and cfg.agent.enabled("guess") and not cfg.agent.enabled("add")
    assert TASK_AGENTS["calc"]["tools"] == ["gearshift.rl.agent.builtin:calc"]
    cfg.validate()


def test_the_tool_warmup_teaches_the_call_and_keeps_the_tools_answer_out_of_the_loss(gearshift_model, tmp_path,
                                                                                       tokenizer):
    from gearshift.rl.tasks import make_task
    from gearshift.rl.warmup import tool_warmup

    rows = make_task("calc", 64, seed=1)
    out = tool_warmup(gearshift_model, tmp_path / "m", rows, steps=2, batch_size=8)
    with pytest.raises(ValueError, match="answers='copied'"):
        tool_warmup(gearshift_model, tmp_path / "n", rows, steps=1, batch_size=8, answers="copied")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_small_calcs_warmup_answers_at_random_and_the_near_one_one_digit_off(gearshift_model, tokenizer,
                                                                                monkeypatch, tmp_path):
    """`small-calc` (the default warm-up) starts at chance: its final answers are drawn from the task's answers
    of the tool's answer's length, not read from the tool's; `answers="shuffled"` draws from all of them, lengths
    mixed; `answers="near"` gives the tool's answer with one digit changed."""
    import gearshift.rl.warmup as warmup
    from gearshift.rl.agent.builtin import calc
    from gearshift.rl.tasks import make_task

    seen = {}
    monkeypatch.setattr(warmup, "_fit", lambda base, out, prompts, episodes, masks, rng, **kw: seen.update(
        episodes=episodes, masks=masks))
    rows = make_task("calc", 400, seed=1)

    def finals(**kw):
        warmup.tool_warmup(gearshift_model, tmp_path / "m", rows, **kw)
        out = []
        for episode, mask in zip(seen["episodes"], seen["masks"]):
            answer = [t for t, m in zip(episode, mask) if m][-(mask[::-1].index(0)):]  # after the tool's result
            out.append(tokenizer.decode(answer[:-1]).strip())  # the end token dropped
        return out

    def one_digit_off(a: str, v: str) -> bool:
        return len(a) == len(v) and sum(x != y for x, y in zip(a, v)) == 1

    values = [calc(r["prompt"].rstrip("=")) for r in rows]
    default = finals()
    assert set(default) <= {r["answer"] for r in rows}
    right = sum(a == v for a, v in zip(default, values)) / len(rows)
    one_off = sum(one_digit_off(a, v) for a, v in zip(default, values))
    assert right < 0.1 and one_off / len(rows) < 0.5, (right, one_off)
    assert all(len(a) == len(v) for a, v in zip(default, values))
    shuffled = finals(answers="shuffled")
    assert set(shuffled) <= {r["answer"] for r in rows}
    assert sum(a == v for a, v in zip(shuffled, values)) / len(rows) < 0.1
    assert 0.2 < sum(len(a) != len(v) for a, v in zip(shuffled, values)) / len(rows) < 0.8
    assert all(one_digit_off(a, v) for a, v in zip(finals(answers="near"), values))


def test_the_tool_warmups_answers_are_one_digit_off_the_tools_and_the_task_pays_only_the_exact_one():
    import random

    from gearshift.rl.rewards import load_reward
    from gearshift.rl.tasks import TASK_REWARDS
    from gearshift.rl.warmup import near_miss

    rng = random.Random(0)
    for answer in ["7", "85", "100", "198"] * 50:
        wrong = near_miss(answer, rng)
        assert wrong != answer and len(wrong) == len(answer) and wrong.isdigit()
        assert sum(a != b for a, b in zip(wrong, answer)) == 1
        assert len(wrong) == 1 or wrong[0] != "0"
    assert {near_miss("85", rng) for _ in range(400)} == {f"{d}5" for d in "12345679"} | {f"8{d}" for d in "012346789"}
    reward = load_reward(TASK_REWARDS["calc"])  # a fixed or a near answer earns nothing, unlike digits_match
    assert reward(" 85", answer="85") == 1.0 and reward("87", answer="85") == reward("177", answer="85") == 0.0


def test_chat_prompts_are_rendered_with_the_tools_schemas(tokenizer):
    import copy

    from gearshift.rl.data import PromptDataset

    tok = copy.copy(tokenizer)
    tok.chat_template = HERMES
    agent = Agent(AgentConfig(tools=[add]), tok)
    data = PromptDataset([{"prompt": [{"role": "user", "content": "1+2?"}]}])
    data.bind(tok, tools=agent.schemas())
    text = tok.decode(data.next_batch(1)[0]["prompt_ids"])
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "add"' in text
    assert text.endswith("<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n")
    assert Agent(AgentConfig(tools=[add]), tokenizer).schemas() == []  # the text format: nothing to render
