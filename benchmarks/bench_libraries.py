"""The hand-written sentence splitter and MinHash against maintained libraries (issue #15): speed, and agreement
with the current output, on the sample dataset at the dataset card's row lengths. Prints figures; never asserts.

    python benchmarks/bench_libraries.py [--rows-per-split 64] [--size-scale 1.0] [--perturbed 30] [--out DIR]

The libraries are not dependencies of raytrain; this run used
``pip install pysbd==0.3.4 blingfire==0.1.8 datasketch==2.0.0`` (numpy 2.3.5, scipy 1.17.1, Python 3.11).

Rows: ``raytrain.sample_data.write_sample_dataset`` (what bench_enrich.py uses) with ``size_scale=1.0``, so code
rows average ~48 KB and math ~37 KB with ``<think>`` traces, as on the dataset card.

Sentences, on what the enrichment splits: the texts ``context.candidate_sentences`` hands to ``split_sentences``
(system prompts less toggle lines, turns before the last user turn) and the sample corpus documents
(``corpus.document_sentences``). Contenders: ours; pysbd and blingfire on the whole text (a drop-in replacement);
and each library only inside a line, with our fenced-code and newline rules kept ("in lines"). Agreement with
ours: texts whose unit list is identical, and precision/recall of the boundaries, counted as offsets in the text
with whitespace removed (so a library that rewrites whitespace is not penalised for it); then the same after
``prose_units`` (the candidate lists the scorer sees). A second, larger set (the prose lines of the long rows'
answers and traces, not split by the enrichment today) gives the speeds more volume.

MinHash, as passes.near_dedup does it: the normalized text's character 5-grams (SHINGLE_CHARS), NUM_PERM=128.
datasketch gets the same shingles (the distinct 5-character strings of ``normalize_text``, UTF-8) with its default
scheme (affine32, sha1_hash32). Pairs: the planted near-duplicates, perturbed copies of some rows (a fraction of
words replaced) with each other and with their original, and random pairs of rows; J_true is the exact Jaccard of
the two 5-gram string sets. LSH: our banding (lsh_params at enrich.near_dup_threshold) against
datasketch.MinHashLSH at the same threshold (its default weights, and the recall-heavy weights lsh_params uses),
over all rows plus the copies.

Note (2026-12-04, 2-core machine shared with Spark runs, load average 5-9; speeds are CPU seconds of this process):
- sentences, on what the enrichment splits (294 texts, 73,473 characters): ours 11.5M chars/s; pysbd 36K (0.003x),
  identical unit lists on 0.891 of the texts (boundary P 0.891 / R 0.995: it splits fenced code into lines);
  blingfire 10.7M (0.94x; 0.7x to 1.9x over runs), identical 0.449 (R 0.670: newlines and fences are not
  boundaries to it). Inside our fence and line rules: pysbd identical 0.929 (splits after "approx." before a
  number), blingfire 0.915 (P 0.963 / R 0.990: splits after "Dr.", and misses the boundary before one).
- MinHash, 303 rows of 25 KB on average: ours 250 rows/s; datasketch update_batch 108 rows/s (0.43x), bulk 0.45x,
  on our shingle hashes 0.68x. Mean |J_est - J_true| over 756 pairs 0.0259 ours, 0.0256 datasketch; over 12 seeds
  the error is 1.015 (ours) and 0.963 (datasketch) ideal standard errors (RMS). At 0.8 they disagree on 23 pairs,
  all with J_true in [0.696, 0.847]. MinHashLSH with its default weights bands 9x13 and finds 58 of the 79 true
  pairs as candidates; with weights (0.1, 0.9) it bands 14x9 like lsh_params and finds 75 (ours: 71).
"""

from __future__ import annotations

import argparse
import functools
import glob
import itertools
import json
import os
import random
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


# ---- rows ---------------------------------------------------------------------------------------------------------
def load_examples(out_dir: str, rows_per_split: int, size_scale: float):
    """(deduplicated Examples as near_dedup sees them, corpus document texts, planted near-duplicate uuid pairs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain.config import EnrichConfig
    from raytrain.enrich.conversation import Example, derive_example
    from raytrain.enrich.dedup import exact_key
    from raytrain.sample_data import load_planted, write_sample_dataset

    sample = write_sample_dataset(out_dir, rows_per_split=rows_per_split, size_scale=size_scale)
    rows = pa.concat_tables([pq.read_table(p) for p in sample.all_files()]).to_pylist()
    examples = [e for e in (derive_example(r, max_chars=EnrichConfig().max_chars) for r in rows)
                if isinstance(e, Example)]
    best: dict = {}
    for e in examples:  # exact_dedup runs before near_dedup: keep the smallest uuid per normalized text
        k = exact_key(e.full_text())
        if k not in best or e.uuid < best[k].uuid:
            best[k] = e
    examples = sorted(best.values(), key=lambda e: e.uuid)
    with open(os.path.join(out_dir, "corpus", "documents.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    planted = [(p["uuid"], p["duplicate_of"]) for p in load_planted(out_dir)["near_duplicates"]]
    return examples, docs, planted


# ---- sentences ----------------------------------------------------------------------------------------------------
def split_inputs(examples) -> list[str]:
    """The texts candidate_sentences passes to split_sentences, in order."""
    from raytrain.enrich.context import last_user_index, split_system_prompt
    from raytrain.enrich.conversation import render_message_text

    out = []
    for e in examples:
        for m in e.messages[: last_user_index(e.messages)]:
            out.append(split_system_prompt(m["content"])[1] if m["role"] == "system" else render_message_text(m))
    return [t for t in out if t.strip()]


def long_prose(examples, max_chars: int) -> list[str]:
    """Prose lines (>= 3 words, not markup or code) of the long rows' assistant turns, up to max_chars in all."""
    from raytrain.enrich.context import prose_units
    from raytrain.enrich.sentences import split_code_blocks

    out, total = [], 0
    for e in sorted(examples, key=lambda e: -len(e.answer)):
        for is_code, chunk in split_code_blocks(e.answer):
            if is_code:
                continue
            for line in prose_units([ln.strip() for ln in chunk.splitlines()]):
                out.append(line)
                total += len(line)
                if total >= max_chars:
                    return out
    return out


def splitters():
    """name -> text -> list of stripped, non-empty units."""
    import blingfire
    import pysbd

    from raytrain.enrich.sentences import split_code_blocks, split_sentences

    seg = pysbd.Segmenter(language="en", clean=False)

    def pysbd_split(text: str) -> list[str]:
        return [s.strip() for s in seg.segment(text) if s.strip()]

    def blingfire_split(text: str) -> list[str]:
        return [s.strip() for s in blingfire.text_to_sentences(text).split("\n") if s.strip()] if text.strip() else []

    def in_lines(split_line):
        def split(text: str) -> list[str]:  # split_sentences with the regex boundary rule replaced by the library
            units = []
            for is_code, chunk in split_code_blocks(text):
                if is_code:
                    units.append(chunk.strip("\n"))
                    continue
                for line in chunk.splitlines():
                    units.extend(split_line(line) if line.strip() else [])
            return [u.strip() for u in units if u.strip()]
        return split

    return {"ours": split_sentences, "pysbd": pysbd_split, "blingfire": blingfire_split,
            "pysbd in lines": in_lines(pysbd_split), "blingfire in lines": in_lines(blingfire_split)}


def _nonspace_boundaries(units: list[str]) -> tuple[set[int], str]:
    """Offsets (in the whitespace-free text) where a unit ends and another begins, and the whitespace-free text."""
    bounds, pos, kept = set(), 0, []
    for u in units:
        squeezed = "".join(u.split())
        kept.append(squeezed)
        pos += len(squeezed)
        bounds.add(pos)
    bounds.discard(pos)  # the end of the text is not a boundary
    return bounds, "".join(kept)


def compare_splits(texts: list[str], ours: list[list[str]], theirs: list[list[str]]) -> dict:
    """Identical lists, boundary precision/recall against ours, texts whose characters a splitter changed."""
    from raytrain.enrich.context import prose_units

    same = same_prose = tp = fp = fn = changed = 0
    for text, a, b in zip(texts, ours, theirs, strict=True):
        same += a == b
        same_prose += prose_units(a) == prose_units(b)
        ba, sa = _nonspace_boundaries(a)
        bb, sb = _nonspace_boundaries(b)
        if sb != "".join(text.split()) or sa != sb:
            changed += 1
            continue
        tp, fp, fn = tp + len(ba & bb), fp + len(bb - ba), fn + len(ba - bb)
    return {"identical": same / len(texts), "identical_prose": same_prose / len(texts),
            "precision": tp / max(1, tp + fp), "recall": tp / max(1, tp + fn), "changed_text": changed}


def cpu_seconds(run) -> float:
    """CPU seconds of this process spent in ``run()`` (these contenders are single-threaded; other jobs on a shared
    machine slow the wall clock, much less the process's own CPU time)."""
    t0 = time.process_time()
    run()
    return time.process_time() - t0


def bench_sentences(name: str, texts: list[str], repeats: int, show_diffs: int) -> None:
    chars = sum(map(len, texts))
    split_fns = splitters()
    results = {label: [split(t) for t in texts] for label, split in split_fns.items()}  # also warms pysbd
    seconds = dict.fromkeys(split_fns, float("inf"))
    for round_ in range(repeats):  # interleaved rounds, best kept; pysbd: one round is enough to rank it
        for label, split in split_fns.items():
            if round_ == 0 or not label.startswith("pysbd"):
                seconds[label] = min(seconds[label], cpu_seconds(lambda split=split: [split(t) for t in texts]))
    n_ours = sum(map(len, results["ours"]))
    print(f"\n[sentences: {name}] {len(texts)} texts, {chars:,} characters, {n_ours:,} units by ours; speeds in CPU "
          f"seconds, best of {repeats} (pysbd: 1)")
    print(f"  {'splitter':<20}{'chars/s':>12}{'units/s':>11}{'vs ours':>9}{'units':>8}{'identical':>11}"
          f"{'ident. prose':>14}{'bound. P':>10}{'bound. R':>10}{'changed':>9}")
    for label, out in results.items():
        s = seconds[label]
        n = sum(map(len, out))
        cmp = compare_splits(texts, results["ours"], out)
        print(f"  {label:<20}{chars / s:>12,.0f}{n / s:>11,.0f}{seconds['ours'] / s:>8.3f}x{n:>8,}"
              f"{cmp['identical']:>11.3f}{cmp['identical_prose']:>14.3f}{cmp['precision']:>10.3f}"
              f"{cmp['recall']:>10.3f}{cmp['changed_text']:>9}")
    for label in [k for k in results if k != "ours"]:
        diffs = [(a, b) for a, b in zip(results["ours"], results[label], strict=True) if a != b]
        for a, b in diffs[:show_diffs]:
            i = next(k for k, (x, y) in enumerate(zip(a + [""], b + [""], strict=False)) if x != y)
            print(f"  e.g. {label}: ours {a[i:i + 2]!r:.150}\n{'':<{len(label) + 8}}lib  {b[i:i + 2]!r:.150}")


# ---- MinHash ------------------------------------------------------------------------------------------------------
def shingle_strings(text: str, n: int) -> set[str]:
    """The distinct n-character strings of the normalized text (the whole text when shorter, none when empty)."""
    from raytrain.enrich.dedup import normalize_text

    norm = normalize_text(text)
    if len(norm) <= n:
        return {norm} if norm else set()
    return {norm[i : i + n] for i in range(len(norm) - n + 1)}


def perturb(text: str, fraction: float, rng: random.Random) -> str:
    """``text`` with ``fraction`` of its whitespace-separated words replaced by fresh random words."""
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, int(fraction * len(words)))):
        words[i] = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
    return " ".join(words)


def ds_minhashes(texts: list[str], ngram: int, num_perm: int, bulk: bool = False) -> list:
    from datasketch import MinHash

    if bulk:
        return MinHash.bulk(([s.encode("utf-8") for s in shingle_strings(t, ngram)] for t in texts),
                            num_perm=num_perm)
    out = []
    for t in texts:
        m = MinHash(num_perm=num_perm)
        m.update_batch([s.encode("utf-8") for s in shingle_strings(t, ngram)])
        out.append(m)
    return out


def _identity(x):
    return x


def ds_minhashes_on_our_hashes(texts: list[str], ngram: int, num_perm: int) -> list:
    """datasketch's best case: our 64-bit shingle hashes fed straight in (scheme affine64, identity hashfunc)."""
    from datasketch import MinHash

    from raytrain.enrich.dedup import shingle_hashes

    out = []
    for t in texts:
        m = MinHash(num_perm=num_perm, hashfunc=_identity, scheme="affine64")
        m.update_batch(shingle_hashes(t, ngram).tolist())
        out.append(m)
    return out


def lsh_pairs_ours(sigs: np.ndarray, bands: int, rows: int) -> set[tuple[int, int]]:
    from raytrain.enrich.dedup import lsh_band_keys

    buckets: dict[int, list[int]] = defaultdict(list)
    for i, keys in enumerate(lsh_band_keys(sigs, bands, rows).tolist()):  # (N, B)
        for k in keys:
            buckets[k].append(i)
    return {p for m in buckets.values() for p in itertools.combinations(sorted(set(m)), 2)}


def lsh_pairs_ds(mhs: list, threshold: float, num_perm: int, weights=(0.5, 0.5)) -> tuple[set[tuple[int, int]], tuple]:
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=weights)
    for i, m in enumerate(mhs):
        lsh.insert(i, m)
    pairs = {tuple(sorted((i, j))) for i, m in enumerate(mhs) for j in lsh.query(m) if j != i}
    return pairs, (lsh.b, lsh.r)


def seed_accuracy(texts: list[str], table: list[tuple], n_seeds: int, rng: random.Random, max_pairs: int = 60) -> None:
    """Error of the estimate in units of its ideal standard error sqrt(J (1 - J) / num_perm), over ``n_seeds``
    independent hash families of each implementation: an ideal MinHash has RMS 1. One seed is one draw per pair;
    several seeds separate the estimator's accuracy from the luck of one permutation set."""
    from datasketch import MinHash

    from raytrain.enrich.dedup import minhash_signature
    from raytrain.enrich.passes import NUM_PERM, SHINGLE_CHARS

    if not table or n_seeds < 1:
        return
    pairs = rng.sample(table, min(max_pairs, len(table)))
    idx = sorted({i for _, i, j, *_ in pairs} | {j for _, i, j, *_ in pairs})
    encoded = {i: [s.encode("utf-8") for s in shingle_strings(texts[i], SHINGLE_CHARS)] for i in idx}
    z_o, z_d = [], []
    for seed in range(n_seeds):
        sig = {i: minhash_signature(texts[i], num_perm=NUM_PERM, ngram=SHINGLE_CHARS, seed=seed) for i in idx}
        mh = {}
        for i in idx:
            mh[i] = MinHash(num_perm=NUM_PERM, seed=seed + 1)
            mh[i].update_batch(encoded[i])
        for _, i, j, true, *_ in pairs:
            sd = (true * (1.0 - true) / NUM_PERM) ** 0.5
            z_o.append((float(np.mean(sig[i] == sig[j])) - true) / sd)
            z_d.append((mh[i].jaccard(mh[j]) - true) / sd)
    zo, zd = np.array(z_o), np.array(z_d)
    print(f"  over {n_seeds} seeds x {len(pairs)} pairs with J_true in [0.5, 1): error / ideal standard error: "
          f"RMS ours {np.sqrt(np.mean(zo ** 2)):.3f}, datasketch {np.sqrt(np.mean(zd ** 2)):.3f} (ideal 1); mean "
          f"ours {zo.mean():+.3f}, datasketch {zd.mean():+.3f} (ideal 0); |z| > 3: ours {int((np.abs(zo) > 3).sum())}, "
          f"datasketch {int((np.abs(zd) > 3).sum())} of {len(zo)}")


def bench_minhash(examples, planted, threshold: float, n_perturbed: int, n_random: int, n_seeds: int,
                  repeats: int, seed: int) -> None:
    from datasketch import LeanMinHash

    from raytrain.enrich.dedup import lsh_params, minhash_signature
    from raytrain.enrich.passes import NUM_PERM, SHINGLE_CHARS

    rng = random.Random(seed)
    texts = [e.full_text() for e in examples]
    chars = sum(map(len, texts))
    n_orig = len(texts)

    # -- speed, on the sample rows (the perturbed copies below are not timed): CPU seconds of this process, best
    # of ``repeats`` rounds with the contenders interleaved, so other jobs on the machine move them all alike
    def ours_sigs():
        return np.stack([minhash_signature(t, num_perm=NUM_PERM, ngram=SHINGLE_CHARS) for t in texts])  # (N, P)

    def lean():
        return [LeanMinHash(m) for m in ds_minhashes(texts, SHINGLE_CHARS, NUM_PERM)]

    contenders = {
        "ours minhash_signature": ours_sigs,
        "datasketch MinHash.update_batch (+ shingle set)": lambda: ds_minhashes(texts, SHINGLE_CHARS, NUM_PERM),
        "datasketch MinHash.bulk (+ shingle set)": lambda: ds_minhashes(texts, SHINGLE_CHARS, NUM_PERM, bulk=True),
        "  of which: building the 5-gram string sets": lambda: [shingle_strings(t, SHINGLE_CHARS) for t in texts],
        "datasketch update_batch + LeanMinHash()": lean,
        "datasketch affine64 on our shingle_hashes": lambda: ds_minhashes_on_our_hashes(texts, SHINGLE_CHARS,
                                                                                        NUM_PERM),
    }
    seconds = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for label, run in contenders.items():
            seconds[label] = min(seconds[label], cpu_seconds(run))
    ours, ds = ours_sigs(), ds_minhashes(texts, SHINGLE_CHARS, NUM_PERM)
    sets = [shingle_strings(t, SHINGLE_CHARS) for t in texts]
    s_ours = seconds["ours minhash_signature"]
    print(f"\n[minhash speed] {n_orig} rows (exact duplicates dropped), {chars:,} characters, num_perm={NUM_PERM}, "
          f"character {SHINGLE_CHARS}-grams")
    print(f"  {'contender (CPU s, best of ' + str(repeats) + ')':<46}{'rows/s':>9}{'chars/s':>12}{'vs ours':>9}")
    for label, s in seconds.items():
        print(f"  {label:<46}{n_orig / s:>9.1f}{chars / s:>12,.0f}{s_ours / s:>8.3f}x")

    # -- perturbed copies: families of (original, copies at several edit fractions)
    fractions = (0.01, 0.03, 0.06, 0.1, 0.2)
    families = []
    for i in sorted(rng.sample(range(n_orig), min(n_perturbed, n_orig))):
        members = [i]
        for f in fractions:
            texts.append(perturb(texts[i], f, rng))
            members.append(len(texts) - 1)
        families.append(members)
    ours = np.vstack([ours, np.stack([minhash_signature(t, num_perm=NUM_PERM, ngram=SHINGLE_CHARS)
                                      for t in texts[n_orig:]])])
    ds += ds_minhashes(texts[n_orig:], SHINGLE_CHARS, NUM_PERM)
    uuid_index = {e.uuid: i for i, e in enumerate(examples)}
    pairs = {("planted", tuple(sorted((uuid_index[a], uuid_index[b]))))
             for a, b in planted if a in uuid_index and b in uuid_index}
    pairs |= {("perturbed", p) for m in families for p in itertools.combinations(m, 2)}
    while len([p for p in pairs if p[0] == "random"]) < n_random:
        a, b = sorted(rng.sample(range(n_orig), 2))
        pairs.add(("random", (a, b)))

    # -- LSH candidates over all rows + copies
    bands, rows = lsh_params(threshold, NUM_PERM)
    cand_ours = lsh_pairs_ours(ours, bands, rows)
    cand_ds, ds_params = lsh_pairs_ds(ds, threshold, NUM_PERM)
    cand_ds_same, ds_same_params = lsh_pairs_ds(ds, threshold, NUM_PERM, weights=(0.1, 0.9))  # ours: fn_weight 0.9
    for p in cand_ours | cand_ds | cand_ds_same:
        if not any(q == p for _, q in pairs):
            pairs.add(("lsh candidate", p))

    # -- exact Jaccard of every evaluated pair (string sets, built again for the copies)
    @functools.lru_cache(maxsize=64)
    def sset(i: int) -> frozenset:
        return frozenset(sets[i]) if i < n_orig else frozenset(shingle_strings(texts[i], SHINGLE_CHARS))

    table = []  # (kind, i, j, J_true, est_ours, est_ds)
    for kind, (i, j) in sorted(pairs, key=lambda x: x[1]):
        a, b = sset(i), sset(j)
        true = len(a & b) / max(1, len(a | b))
        table.append((kind, i, j, true, float(np.mean(ours[i] == ours[j])), ds[i].jaccard(ds[j])))
    t = np.array([r[3:] for r in table])  # (pairs, 3): J_true, ours, datasketch
    kinds = np.array([r[0] for r in table])
    print(f"\n[minhash agreement] {len(table)} pairs ({', '.join(f'{k} {int((kinds == k).sum())}' for k in sorted(set(kinds)))}); "
          f"perturbed copies edit {', '.join(f'{f:.0%}' for f in fractions)} of the words of {len(families)} rows")
    print(f"  {'J_true':<12}{'pairs':>7}{'mean|err| ours':>16}{'datasketch':>12}{'max|err| ours':>15}{'datasketch':>12}"
          f"{'bias ours':>11}{'datasketch':>12}")
    for lo, hi in ((0.0, 0.5), (0.5, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0001)):
        sel = (t[:, 0] >= lo) & (t[:, 0] < hi)
        if not sel.any():
            continue
        e_o, e_d = np.abs(t[sel, 1] - t[sel, 0]), np.abs(t[sel, 2] - t[sel, 0])
        print(f"  [{lo:.1f}, {min(hi, 1.0):.1f}){'':<2}{int(sel.sum()):>7}{e_o.mean():>16.4f}{e_d.mean():>12.4f}"
              f"{e_o.max():>15.4f}{e_d.max():>12.4f}{(t[sel, 1] - t[sel, 0]).mean():>11.4f}"
              f"{(t[sel, 2] - t[sel, 0]).mean():>12.4f}")
    e_o, e_d = np.abs(t[:, 1] - t[:, 0]), np.abs(t[:, 2] - t[:, 0])
    print(f"  {'all':<12}{len(t):>7}{e_o.mean():>16.4f}{e_d.mean():>12.4f}{e_o.max():>15.4f}{e_d.max():>12.4f}"
          f"{(t[:, 1] - t[:, 0]).mean():>11.4f}{(t[:, 2] - t[:, 0]).mean():>12.4f}")
    truth, p_o, p_d = t[:, 0] >= threshold, t[:, 1] >= threshold, t[:, 2] >= threshold
    print(f"  threshold {threshold}: true pairs {int(truth.sum())}; ours passes {int(p_o.sum())} (missed "
          f"{int((truth & ~p_o).sum())}, false {int((~truth & p_o).sum())}); datasketch passes {int(p_d.sum())} "
          f"(missed {int((truth & ~p_d).sum())}, false {int((~truth & p_d).sum())}); ours and datasketch differ on "
          f"{int((p_o != p_d).sum())} pairs")
    differ = p_o != p_d
    if differ.any():
        print(f"  J_true of the pairs they differ on: {t[differ, 0].min():.4f} to {t[differ, 0].max():.4f} (the ideal "
              f"standard error at {threshold} is {(threshold * (1 - threshold) / NUM_PERM) ** 0.5:.4f})")
    for k in np.flatnonzero(differ)[:5]:
        kind, i, j, true, eo, ed = table[k]
        print(f"    e.g. {kind} pair ({i}, {j}): J_true {true:.4f}, ours {eo:.4f}, datasketch {ed:.4f}")

    seed_accuracy(texts, [r for r in table if 0.5 <= r[3] < 1.0], n_seeds, rng)

    # -- LSH: candidates and verified pairs (candidate and estimate >= threshold) against the true pairs
    true_pairs = {(r[1], r[2]) for r in table if r[3] >= threshold}
    est = {(r[1], r[2]): (r[4], r[5]) for r in table}
    print(f"\n[LSH] {len(texts)} rows ({n_orig} + {len(texts) - n_orig} copies), threshold {threshold}; "
          f"{len(true_pairs)} true pairs (J_true >= {threshold}) among the evaluated pairs")
    print(f"  {'banding':<44}{'b x r':>8}{'candidates':>12}{'true found':>12}{'verified':>10}{'verified true':>15}")
    rows_out = (("ours (lsh_params, fn_weight 0.9)", (bands, rows), cand_ours, 0),
                ("datasketch MinHashLSH (its default weights)", ds_params, cand_ds, 1),
                ("datasketch MinHashLSH, weights=(0.1, 0.9)", ds_same_params, cand_ds_same, 1))
    verified_sets = {}
    for label, (b, r), cand, which in rows_out:
        verified = {p for p in cand if est[p][which] >= threshold}
        verified_sets[label] = verified
        print(f"  {label:<44}{f'{b}x{r}':>8}{len(cand):>12}{len(cand & true_pairs):>12}{len(verified):>10}"
              f"{len(verified & true_pairs):>15}")
    labels = [r[0] for r in rows_out]
    print(f"  candidate pairs ours & datasketch default: {len(cand_ours & cand_ds)} shared, "
          f"{len(cand_ours - cand_ds)} only ours, {len(cand_ds - cand_ours)} only datasketch; verified pairs: "
          f"{len(verified_sets[labels[0]] & verified_sets[labels[1]])} shared, "
          f"{len(verified_sets[labels[0]] - verified_sets[labels[1]])} only ours, "
          f"{len(verified_sets[labels[1]] - verified_sets[labels[0]])} only datasketch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-per-split", type=int, default=64)
    parser.add_argument("--size-scale", type=float, default=1.0)
    parser.add_argument("--perturbed", type=int, default=30, help="rows that get perturbed copies")
    parser.add_argument("--random-pairs", type=int, default=300)
    parser.add_argument("--long-prose-chars", type=int, default=300_000)
    parser.add_argument("--repeats", type=int, default=3, help="timing passes of the fast splitters (best kept)")
    parser.add_argument("--minhash-repeats", type=int, default=2, help="timing rounds of the MinHash contenders")
    parser.add_argument("--show-diffs", type=int, default=3, help="disagreements printed per splitter")
    parser.add_argument("--seeds", type=int, default=12, help="hash seeds for the accuracy check of each MinHash")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/bench_libraries")
    args = parser.parse_args()

    import blingfire
    import datasketch
    import pysbd

    from raytrain.config import EnrichConfig

    t_start = time.perf_counter()
    examples, docs, planted = load_examples(os.path.join(args.out, "sample"), args.rows_per_split, args.size_scale)
    versions = {m.__name__: getattr(m, "__version__", "?") for m in (pysbd, datasketch, np)}
    try:
        from importlib.metadata import version
        versions["blingfire"] = version("blingfire")
    except Exception:  # the version is a label here, nothing depends on it
        versions["blingfire"] = getattr(blingfire, "__version__", "?")
    print(f"{os.cpu_count()} cores, 1-min load average {os.getloadavg()[0]:.1f}; versions {versions}; "
          f"{len(examples)} rows, {len(glob.glob(os.path.join(args.out, 'sample', 'data', '*.parquet')))} files, "
          f"size_scale {args.size_scale}")

    bench_sentences("what the enrichment splits (candidate_sentences inputs + corpus documents)",
                    split_inputs(examples) + docs, args.repeats, args.show_diffs)
    bench_sentences("prose lines of the long rows' answers (volume; not split today)",
                    long_prose(examples, args.long_prose_chars), args.repeats, 0)
    bench_minhash(examples, planted, EnrichConfig().near_dup_threshold, args.perturbed, args.random_pairs,
                  args.seeds, args.minhash_repeats, args.seed)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; 1-min load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
