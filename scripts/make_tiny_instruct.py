#!/usr/bin/env python3
"""Makes the bundled fine-tune data and tokenizer in examples/tiny_llama.

Writes data/train.jsonl and data/eval.jsonl ({"prompt": ..., "response": ...}
records of small digit tasks with exactly checkable answers) and trains
tokenizer.model with spm_train (Debian package `sentencepiece`) on the text of
the training set.

The tasks are chosen so that a randomly initialised ~3M-parameter Llama learns
them, and generalises to unseen inputs, in a few hundred optimizer steps on two
CPU cores: each answer is a short function of digits that are visible in the
prompt (copy, reverse, sort, max, min, count, successor, small addition).
Every eval prompt is absent from the training set, so eval exact match measures
generalisation rather than memorisation.

Standard library only; the output is a deterministic function of the
arguments (fixed seed, single-threaded spm_train).

Usage (from the repository root):
    python3 scripts/make_tiny_instruct.py
    python3 scripts/make_tiny_instruct.py --out-dir /tmp/tiny --train 20000 --eval 200
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

DIGITS = "0123456789"

# (task name, prompt templates). Several phrasings per task so the prompt reads
# like an instruction and the model must find the operation from the words.
TEMPLATES = {
    "copy": ["Repeat {s}", "Copy the digits {s}", "Write {s} again"],
    "reverse": ["Reverse {s}", "Write {s} backwards", "Reverse the digits {s}"],
    "sort": ["Sort the digits {s}", "Sort {s} in increasing order"],
    "max": ["What is the largest digit in {s}?", "Largest digit of {s}"],
    "min": ["What is the smallest digit in {s}?", "Smallest digit of {s}"],
    "count": ["How many times does {d} appear in {s}?", "Count the digit {d} in {s}"],
    "next": ["What number comes after {n}?", "Add one to {n}"],
    "add": ["What is {a} + {b}?", "Compute {a} + {b}"],
}
TASKS = list(TEMPLATES)


def digit_string(rng, lo=3, hi=7):
    return "".join(rng.choice(DIGITS) for _ in range(rng.randint(lo, hi)))


def make_record(rng, task):
    """One (prompt, response) pair of `task`; responses are at most 7 digits."""
    template = rng.choice(TEMPLATES[task])
    if task in ("copy", "reverse", "sort", "max", "min"):
        s = digit_string(rng)
        response = {
            "copy": s,
            "reverse": s[::-1],
            "sort": "".join(sorted(s)),
            "max": max(s),
            "min": min(s),
        }[task]
        return template.format(s=s), response
    if task == "count":
        s = digit_string(rng, 4, 8)
        # Half the questions ask for a digit that is present, so answers are not
        # dominated by 0 and 1.
        d = rng.choice(s) if rng.random() < 0.5 else rng.choice(DIGITS)
        return template.format(s=s, d=d), str(s.count(d))
    if task == "next":
        # Numbers ending in 9s are over-represented so carries are learnt.
        n = rng.randint(0, 9999)
        if rng.random() < 0.3:
            k = rng.randint(1, 3)
            n = (n // 10**k) * 10**k + (10**k - 1)
        return template.format(n=n), str(n + 1)
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 9)
        return template.format(a=a, b=b), str(a + b)
    raise ValueError(task)


def make_split(rng, count, exclude, exclude_pairs=False):
    """`count` records cycling through the tasks. Prompts in `exclude` are
    skipped; with exclude_pairs the (task, question) pair is excluded whatever
    the phrasing, so a held-out question is not seen in another wording."""
    records, seen = [], set()
    i = 0
    while len(records) < count:
        task = TASKS[i % len(TASKS)]
        prompt, response = make_record(rng, task)
        key = question_key(task, prompt)
        if key in exclude:
            continue
        if exclude_pairs:
            # Eval: every question once.
            if key in seen:
                continue
            seen.add(key)
        records.append({"prompt": prompt, "response": response, "_key": key})
        i += 1
    return records


def question_key(task, prompt):
    """The task plus the numbers in the prompt: the same question in any phrasing."""
    numbers = []
    current = ""
    for ch in prompt:
        if ch.isdigit():
            current += ch
        elif current:
            numbers.append(current)
            current = ""
    if current:
        numbers.append(current)
    return task + ":" + ",".join(numbers)


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"prompt": r["prompt"], "response": r["response"]}, ensure_ascii=False) + "\n")


def train_tokenizer(spm_train, records, out_model, vocab_size, seed):
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "text.txt")
        with open(text, "w", encoding="utf-8") as f:
            for r in records:
                # The training text as the chat template shows it to the model.
                f.write("[INST] " + r["prompt"] + " [/INST] " + r["response"] + "\n")
        # Relative names (run inside `tmp`): the model file records its
        # trainer's input and prefix, and a random temporary path there would
        # make the output differ from run to run.
        cmd = [
            spm_train,
            "--input=text.txt",
            "--model_prefix=tokenizer",
            "--model_type=bpe",
            "--vocab_size=%d" % vocab_size,
            # Llama's conventions: digits are single tokens, unknown characters
            # fall back to UTF-8 bytes, unk/bos/eos = 0/1/2, no pad.
            "--split_digits=true",
            "--byte_fallback=true",
            "--unk_id=0",
            "--bos_id=1",
            "--eos_id=2",
            "--pad_id=-1",
            # Llama 2's normalizer: text kept as is (no NFKC, spaces kept), so
            # decode(encode(text)) == text; it also keeps the model file small.
            "--normalization_rule_name=identity",
            "--remove_extra_whitespaces=false",
            # The chat template's markers as single tokens.
            "--user_defined_symbols=[INST],[/INST]",
            "--character_coverage=1.0",
            "--num_threads=1",
            "--random_seed=%d" % seed,
            "--minloglevel=2",
        ]
        print("scripts/make_tiny_instruct.py: " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, cwd=tmp)
        shutil.copyfile(os.path.join(tmp, "tokenizer.model"), out_model)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=os.path.join(root, "examples", "tiny_llama"))
    parser.add_argument("--train", type=int, default=20000, help="training records")
    parser.add_argument("--eval", type=int, default=200, help="eval records (held-out questions)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--spm-train", default="spm_train", help="sentencepiece's trainer (Debian: sentencepiece)")
    parser.add_argument("--no-tokenizer", action="store_true", help="only write the data")
    args = parser.parse_args()

    spm_train = shutil.which(args.spm_train)
    if spm_train is None and not args.no_tokenizer:
        sys.exit("scripts/make_tiny_instruct.py: error: '%s' not found; install the Debian package "
                 "'sentencepiece' or pass --spm-train PATH" % args.spm_train)

    rng = random.Random(args.seed)
    eval_records = make_split(rng, args.eval, exclude=set(), exclude_pairs=True)
    held_out = {r["_key"] for r in eval_records}
    train_records = make_split(rng, args.train, exclude=held_out)
    rng.shuffle(train_records)

    data_dir = os.path.join(args.out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    write_jsonl(os.path.join(data_dir, "train.jsonl"), train_records)
    write_jsonl(os.path.join(data_dir, "eval.jsonl"), eval_records)
    print("scripts/make_tiny_instruct.py: wrote %d train and %d eval records to %s"
          % (len(train_records), len(eval_records), data_dir), file=sys.stderr)
    if not args.no_tokenizer:
        train_tokenizer(spm_train, train_records, os.path.join(args.out_dir, "tokenizer.model"),
                        args.vocab_size, args.seed)
        print("scripts/make_tiny_instruct.py: wrote %s" % os.path.join(args.out_dir, "tokenizer.model"),
              file=sys.stderr)


if __name__ == "__main__":
    main()
