"""What makes two runs different configurations, in words: the comparability fields (hashes of what must be
equal for two runs to be compared step by step) and the settings a manifest stores, compared key by key, so
that a refusal or a warning names `batch_size 64 -> 32`, not two hashes."""
from __future__ import annotations

from typing import Any

# what must be equal for two runs to be compared step by step (the run's identity minus the backend;
# harness.runner.comparability_hashes computes them)
COMPARABILITY = ("spec_hash", "data_hash", "order_hash", "base_weights_hash", "hparams_hash")


def _table(m: dict[str, Any], key: str) -> dict[str, Any]:
    """A manifest's sub-table, or {} where a hand-edited manifest holds something else there."""
    v = m.get(key)
    return v if isinstance(v, dict) else {}


def what_differs(a: dict[str, Any], b: dict[str, Any], field: str) -> str:
    """In words, what makes a comparability field of two manifests differ: the hashes alone tell a user nothing."""
    if field == "hparams_hash":
        ha, hb = _table(a, "hparams"), _table(b, "hparams")
        keys = [k for k in sorted(set(ha) | set(hb), key=str) if ha.get(k) != hb.get(k)]
        return ", ".join(f"{k} {ha.get(k)} -> {hb.get(k)}" for k in keys) or "the hyper-parameters"
    if field == "spec_hash":
        ma, mb = a.get("model"), b.get("model")
        return f"model {ma} -> {mb}" if ma != mb else f"model {ma}'s spec (another version of it)"
    if field == "data_hash":
        sa, sb = (_table(m, "data").get("source") for m in (a, b))
        if sa and sb and sa != sb:
            return f"data {sa} -> {sb}"
        return f"the data's contents ({sa})" if sa and sa == sb else "the data"
    return {"order_hash": "the batch order (seed, batch size, steps or the data's size)",
            "base_weights_hash": "the initial weights (init seed or model)"}.get(field, field)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """The comparability fields of two manifests that differ, each with what differs in words (what_differs);
    the batch order and the initial weights are left out where a hyper-parameter, the model or the data differs,
    as they follow from those."""
    found = [(f, a.get(f), b.get(f)) for f in COMPARABILITY if a.get(f) != b.get(f)]
    if {"hparams_hash", "spec_hash", "data_hash"} & {f for f, _, _ in found}:
        found = [m for m in found if m[0] not in ("order_hash", "base_weights_hash")]
    return [(f, va, vb, what_differs(a, b, f)) for f, va, vb in found]


def changed_settings(old: Any, new: dict[str, Any]) -> list[str]:
    """The leaves of two nested settings tables (a manifest's `config`) that differ, as "name old -> new"; the
    rendezvous port left out (where to meet, not what is computed)."""
    old = old if isinstance(old, dict) else {}
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k), new.get(k)
        if k == "port" or a == b:
            continue
        out += changed_settings(a, b) if isinstance(a, dict) and isinstance(b, dict) else [f"{k} {a} -> {b}"]
    return out


__all__ = ["COMPARABILITY", "what_differs", "differences", "changed_settings"]
