"""How a new policy version reaches the engines: one engine's push in phases (phases.py), and the
fleet's push over a pool, with per-engine updaters or a barrier and the flip clock (fleet.py)."""
