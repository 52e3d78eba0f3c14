"""The task of examples.demo_rl (game.py, `WeatherGame`): the warm-up's demonstrations are laid out token for token as
the session server builds an episode (Qwen3's template, thinking off), the call they teach is one the server parses, the
warm-up teaches the choice to call at the rate it is given and the lookup on every other demonstration, and the reward
is the final answer against today's weather, whichever way the episode got there."""

from __future__ import annotations

import random
from typing import Any

import pytest

from examples.demo_rl.game import ITEMS, Prompt, WeatherGame
from rollout.episodes import EpisodeResult
from trajectory.families import ModelFamily


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizers: dict[str, Any]) -> Any:
    return hf_tokenizers["qwen3"]


@pytest.fixture(scope="module")
def game(tokenizer: Any) -> WeatherGame:
    return WeatherGame(tokenizer)


def test_a_demonstration_is_the_episode_the_server_builds(game: WeatherGame,
                                                         families: dict[str, ModelFamily]) -> None:
    family = families["qwen3"]
    prompt_text = family.render([{"role": "user", "content": "wear?"}], None, add_generation_prompt=True,
                                template_kwargs={"enable_thinking": False})
    assert game.first == family.encode(prompt_text)
    call_text = game.tokenizer.decode(game.call_ids()[:-1])
    parsed = family.parse_completion(call_text)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("weather", "{}")] and not parsed.content
    appended = family.render_appended([{"role": "tool", "content": "snow"}], None, {"enable_thinking": False})
    assert appended is not None
    # After the call's <|im_end|> the server appends the template's message trailer, then the tool's block.
    assert game.tool_reply_ids("snow") == family.encode(family.message_trailer + appended)
    ids, mask = game.demonstration(Prompt("snow"), random.Random(0), p_call=1.0)
    assert ids[-2:] == game.answer_ids("ski") and mask[-2:] == [1, 1]
    assert set(ids) <= set(game.alphabet())


def test_the_warm_up_teaches_the_choice_at_its_rate_and_the_lookup_always(game: WeatherGame) -> None:
    rng = random.Random(1)
    call_token = game.call_ids()[0]
    first = len(game.first)
    taught_calls = taught_choices = lookups = 0
    for _ in range(4000):
        prompt = game.prompt(rng)
        ids, mask = game.demonstration(prompt, rng, p_call=0.1)
        assert len(ids) == len(mask) and mask[:first] == [0] * first
        if ids[first] == call_token:
            assert ids[-2:] == game.answer_ids(prompt.answer)  # after a call, always the weather's item
            if mask[first]:
                taught_calls += 1
                taught_choices += 1
            else:
                lookups += 1  # the lookup taught without the choice to call
        else:
            assert mask[first] == 1 and game.tokenizer.decode(ids[first]) in ITEMS.values()
            taught_choices += 1
    assert 1800 < lookups < 2200
    assert 0.07 < taught_calls / taught_choices < 0.13


def test_the_reward_is_the_item_for_todays_weather(game: WeatherGame) -> None:
    def result(answer: str | None, tool_calls: int = 1, error: str | None = None) -> EpisodeResult:
        return EpisodeResult(index=0, final_answer=answer, tool_calls=tool_calls, error=error)

    rain = Prompt("rain")
    assert rain.answer == "coat"
    assert game.reward(rain, result("coat")) == 1.0
    assert game.reward(rain, result(" coat\n", tool_calls=0)) == 1.0  # a lucky guess counts: the outcome is scored
    assert game.reward(rain, result("hat")) == 0.0
    assert game.reward(rain, result(None)) == 0.0  # no final answer (a length or turn-limit stop)
    assert game.reward(rain, result("coat", error="APIError: boom")) == 0.0
