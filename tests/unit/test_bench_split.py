"""The LLM server bench's split of a wake's time beyond its phases (`llmserver.wake_split`)."""

from __future__ import annotations

from volga_agent.node import instance
from volga_bench import llmserver
from volga_core import api


def test_a_wake_is_split_into_its_phases_the_agents_steps_and_the_rest_of_the_request() -> None:
    moves = [instance.Transition(api.Tier.FROZEN, api.Tier.HOT, 0.5, 0.0, phases={"restore": 0.1, "driver": 0.25,
                                                                                  "wake": 0.12}),
             instance.Transition(api.Tier.FROZEN, api.Tier.HOT, 0.4, 0.0, phases={"restore": 0.1, "driver": 0.2,
                                                                                  "wake": 0.09})]
    split = llmserver.wake_split(moves, [560.0, 430.0])
    assert split["agent_steps"]["all"] == [30.0, 10.0]
    assert split["after_wake"]["all"] == [60.0, 30.0]
    assert "after_wake" not in llmserver.wake_split(moves, [560.0])  # not one first token per wake: left out
    assert llmserver.wake_split([], []) == {}
