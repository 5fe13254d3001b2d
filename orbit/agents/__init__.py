"""Agents and environments as users bring them: an OpenAI-compatible endpoint in front of the
engines that records every token of every episode (endpoint.py, episodes.py), token in and token out
across turns (chat.py), the trajectory an episode trains on (record.py), and agent episodes run
against it (runner.py)."""

from orbit.agents.endpoint import Endpoint, EndpointError
from orbit.agents.runner import AgentEpisode, AgentRunner, EpisodeFailed

__all__ = ["AgentEpisode", "AgentRunner", "Endpoint", "EndpointError", "EpisodeFailed"]
