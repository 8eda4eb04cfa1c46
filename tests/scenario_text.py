"""Small replay scenarios for tests that run ``tunelab tune`` end to end (the TOML text)."""

from __future__ import annotations


def tiny_replay(name: str = "tiny-replay", budget: int = 5, forward_ms: int = 20, backward_ms: int = 40,
                np: int | None = 2, lab: str = "") -> str:
    """A ResNet-50 replay scenario with a small tuning budget and short blocks; ``lab``: a ``[lab]``
    table's body (the scenario then runs on the lab's hosts)."""
    run = f"[run]\nnp = {np}\n" if np is not None else ""
    lab_table = f"[lab]\n{lab.strip()}\n" if lab else ""
    return (f'\nname = "{name}"\nworkload = "replay"\nmodel = "resnet50"\n{run}{lab_table}'
            f"[tuning]\nbudget_samples = {budget}\nwarmup_steps = 1\ndiscard_steps = 1\nmeasure_steps = 2\n"
            f"[replay]\nforward_ms = {forward_ms}\nbackward_ms = {backward_ms}\n")
