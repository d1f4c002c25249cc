# Calibrated thresholds (docs/method.md §6): per slot, a monotone map from a slot's confidence to the
# measured chance that its token is the one greedy AR decoding emits there, given that the slots before
# it were. With a map, `--threshold tau` accepts slot i while map_i(confidence) >= tau, so tau means the
# same on every slot and every checkpoint; without one it is the paper's raw rule.
#
# The labels come from self-verification (§9): a verify step checks each draft it feeds against the
# greedy token, and a draft is the same slot, read the same way, that a threshold step would accept.
# Draft i counts once its drafts 1..i-1 were accepted: right if it was accepted too.
#
# A confident slot that repeats the token before it is the failure a slot's confidence does not show
# (docs/real-model.md: repeats are 15-30% of accepted far slots at tau 0.9, 0.5% of the base's own
# tokens). So each slot has a second map, fitted on the labels whose token repeats its predecessor,
# and a threshold step reads that one where its token does.
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

FILE = "calibration.json"  # beside config.json in a checkpoint directory
VERSION = 2  # 2 added the repeat maps; a version 1 file (one map per slot) still loads


@dataclass(frozen=True)
class Curve:
    # One slot's map: a step function over confidence. Block j covers confidences >= lo[j] (and below
    # lo[j + 1]); p[j], non-decreasing in j, is its chance of being right; n[j] the labels it pools.
    lo: tuple[float, ...]
    p: tuple[float, ...]
    n: tuple[int, ...]

    def __call__(self, conf: float) -> float:
        j = max((i for i, lo in enumerate(self.lo) if conf >= lo), default=0)
        return self.p[j]

    def threshold(self, tau: float) -> float:
        # The least confidence the map sends to >= tau: the raw threshold that tau means on this slot.
        # inf when no block reaches tau (the slot is never accepted); 0 when the first one does.
        j = next((i for i, p in enumerate(self.p) if p >= tau), None)
        return math.inf if j is None else (0.0 if j == 0 else self.lo[j])


def fit(conf: list[float], right: list[bool], bins: int = 20) -> Curve:
    # Isotonic regression (pool adjacent violators) of right on conf, on `bins` quantile bins first so
    # the file stays small. Each block's rate is shrunk to (right + 1) / (n + 2), so a block of three
    # right labels says 0.8, not 1.0, and the shrunk rates are pooled again to stay monotone.
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    if not order:
        return Curve((0.0,), (0.5,), (0,))
    size = max(1, math.ceil(len(order) / bins))
    blocks = []  # [lo, right, n]
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
        blocks.append([conf[chunk[0]], sum(right[i] for i in chunk), len(chunk)])
    blocks = pool(blocks, lambda b: b[1] / b[2])
    blocks = pool(blocks, lambda b: (b[1] + 1) / (b[2] + 2))
    return Curve(tuple(b[0] for b in blocks), tuple((b[1] + 1) / (b[2] + 2) for b in blocks),
                 tuple(b[2] for b in blocks))


def pool(blocks: list[list], rate) -> list[list]:
    # Merges neighbours until rate(block) is non-decreasing; a merged block keeps the lower lo.
    out: list[list] = []
    for b in blocks:
        out.append(list(b))
        while len(out) > 1 and rate(out[-2]) >= rate(out[-1]):
            last = out.pop()
            out[-1] = [out[-1][0], out[-1][1] + last[1], out[-1][2] + last[2]]
    return out


@dataclass(frozen=True)
class Calibration:
    curves: tuple[Curve, ...]  # slot 1, 2, ...: slot 0 is always accepted and needs none
    labels: int = 0  # how many labels the maps were fitted on
    source: str = ""  # what they were fitted on, for the reader of the file
    repeats: tuple[Curve, ...] = ()  # slot 1, 2, ...: the maps of tokens that repeat the one before; () = none

    def thresholds(self, tau: float, slots: int, repeat: bool = False) -> tuple[float, ...]:
        # The raw confidence each of slots 1..slots must reach for calibrated tau (repeat: where its
        # token repeats the one before). A slot past the fitted ones takes the last one's. tau 1 is one
        # token per step by rule: no bars, () as for raw.
        curves = self.repeats if repeat and self.repeats else self.curves
        if tau >= 1.0:
            return ()
        return tuple(curves[min(i, len(curves) - 1)].threshold(tau) for i in range(slots))

    def bars(self, tau: float, slots: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        # (slot_tau, repeat_tau) of generate.Options: the bars of tokens that do not repeat and that do.
        return self.thresholds(tau, slots), self.thresholds(tau, slots, repeat=True) if self.repeats else ()


def from_labels(labels: list[tuple], slots: int, source: str = "", bins: int = 20) -> Calibration:
    # labels: (slot >= 1, confidence, right, repeats) (verify.Stats.labels; without the fourth, no
    # repeat); slots: B - 1. A slot with no labels (no draft before it ever held) gets a chance of 1/2
    # everywhere, so tau above 1/2 never accepts it: a slot whose token never repeated in the labels
    # accepts no repeat.
    def curves(repeat: bool) -> tuple[Curve, ...]:
        maps = []
        for slot in range(1, slots + 1):
            of_slot = [(c, r) for s, c, r, *rep in labels if s == slot and bool(rep and rep[0]) == repeat]
            maps.append(fit([c for c, _ in of_slot], [r for _, r in of_slot], bins))
        return tuple(maps)

    return Calibration(curves(False), len(labels), source, curves(True))


def prompts_of(examples) -> list[list[int]]:
    # The prompt of each tokenized example (data.Examples): its tokens before the first supervised one.
    out = []
    for i in range(len(examples)):
        ids, sup = examples[i]
        out.append(ids[:int(sup.argmax()) if sup.any() else len(ids)].tolist())
    return out


def save(cal: Calibration, folder: str | Path) -> Path:
    path = Path(folder) / FILE
    def listed(curves: tuple[Curve, ...]) -> list[dict]:
        return [{"lo": list(c.lo), "p": list(c.p), "n": list(c.n)} for c in curves]

    body = {"version": VERSION, "labels": cal.labels, "source": cal.source, "slots": listed(cal.curves),
            "repeat_slots": listed(cal.repeats)}
    tmp = path.with_name(f".tmp-{FILE}")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)
    return path


def load(folder: str | Path) -> Calibration | None:
    # A checkpoint's map, or None when it has none. A file that is not a valid map is an error that
    # names it: a wrong map would silently change what tau means.
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(body, dict), f"a JSON {type(body).__name__}, not an object"
        assert body.get("version") in (1, VERSION), f"version {body.get('version')!r}, this code reads 1 and {VERSION}"
        curves, repeats = read_curves(body["slots"], "slot"), read_curves(body.get("repeat_slots", []), "repeat slot")
        assert curves, "no slots"
        labels = body.get("labels", 0)
        assert isinstance(labels, int) and labels >= 0, f"labels {labels!r}, not a count"
        cal = Calibration(curves, labels, str(body.get("source", "")), repeats)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ValueError(f"{path}: not a calibration map ({e}); refit it with python -m tools.calibrate "
                         f"--ckpt {Path(folder)}, or delete it for the raw rule") from None
    return cal


def read_curves(listed: list, what: str) -> tuple[Curve, ...]:
    # A file's list of {"lo", "p", "n"} maps; AssertionError (or a KeyError, TypeError) names a bad one.
    curves = []
    for i, c in enumerate(listed):
        lo, p, n = (tuple(c[k]) for k in ("lo", "p", "n"))
        assert len(lo) == len(p) == len(n) >= 1, f"{what} {i + 1}: lo, p and n differ in length or are empty"
        assert all(0 <= x <= 1 for x in p) and list(p) == sorted(p), f"{what} {i + 1}: p must rise within [0, 1]"
        assert list(lo) == sorted(lo), f"{what} {i + 1}: lo must rise"
        curves.append(Curve(tuple(map(float, lo)), tuple(map(float, p)), tuple(map(int, n))))
    return tuple(curves)


def slot_bars(path, tau: float, B: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    # (slot_tau, repeat_tau): the per-slot bars that tau means under the checkpoint's calibration;
    # ((), ()) = the raw rule, with one warning when tau < 1 and the checkpoint has no map.
    cal = load(path)
    if cal is None and tau < 1.0:
        print(f"warning: {path} has no {FILE}, so --threshold {tau} is the raw rule (the paper's): "
              f"fit a map with python -m tools.calibrate --ckpt {path}, or pass --calibration raw", file=sys.stderr)
    return cal.bars(tau, B - 1) if cal is not None else ((), ())
