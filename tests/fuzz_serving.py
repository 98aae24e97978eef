"""Serving-workload mutants for the spec fuzzer (issue #42; the fuzzer is tests/test_fuzz_spec.py).

A mutant starts from ``SERVE_BASE``, a valid serve spec (vLLM target, simulator backend, engine
settings and environment variables searched), and applies one or two mutations, each to one area
of a serving spec:

- ``traffic``: rates, arrival, burstiness, shared_prefix, duration_s, warmup_requests, seed;
- ``lengths``: prompt_len/output_len, a ``lengths_file`` (JSON lines or CSV) with values such as
  ``Infinity``, ``1e300``, ``true``, duplicate CSV columns, byte-order marks, UTF-16, CRLF, NULs,
  deep nesting, too many records; the file's path (missing, a directory, a FIFO, /dev/zero, a
  symlink loop, a NUL or newline in its name); user-written ``length_pairs``;
- ``slo``: the latency targets (non-finite, zero, negative, unknown names);
- ``engine``: ``space.engine`` names and values (control characters, NUL, flag-like values such as
  ``--enforce-eager``, non-finite numbers, nested values);
- ``env``: ``space.env`` and ``backend.env`` on a serving spec;
- ``space``: the serving parameters (replicas, max_num_seqs, memory_utilization...) and training ones;
- ``workload``: batch_sweep, max_model_len, the timeouts, the workload kind;
- ``stack``: target, backend kind and args, the cluster;
- ``data``: any field of the spec replaced, deleted or added with a value of any type.

Each mutation says what must come of it: ``error`` (``autotune validate`` refuses the spec, exit
2), ``ok`` (accepted, exit 0) or nothing (a spec or located errors, either way). Where the right
answer is a matter of policy (a bidi override in an engine value, ``1_000`` in a CSV cell) the mutation is marked
``question`` instead: the fuzzer counts how often such a spec was accepted, for a person to judge.
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass, field

import yaml

INF, NAN = float("inf"), float("nan")
MAX_SPEC_INT = 2**53 - 1

SERVE_BASE: dict = {
    "name": "serve-fuzz",
    "model": "tiny-llama",
    "workload": {
        "kind": "serve",
        "traffic": {
            "rates": [1, 2, 4],
            "prompt_len": {"low": 64, "high": 192},
            "output_len": 32,
            "arrival": "gamma",
            "burstiness": 0.5,
            "shared_prefix": 0.1,
            "duration_s": 10,
            "warmup_requests": 2,
            "seed": 0,
        },
        "slo": {"ttft_p99_ms": 1000, "tpot_p99_ms": 100},
        "batch_sweep": [1, 4],
        "startup_timeout_s": 300,
        "timeout_s": 900,
    },
    "cluster": {"accelerator": "cpu", "profile": "cpu", "devices_per_node": 4, "cost_per_device_hour": 1.5},
    "target": "vllm",
    "backend": {"kind": "simulate", "env": {"VLLM_LOGGING_LEVEL": "INFO"}},
    "space": {
        "tp": [1, 2],
        "replicas": [1, 2],
        "max_num_seqs": [16, 64],
        "max_num_batched_tokens": [256, 512],
        "enable_chunked_prefill": [True, False],
        "kv_cache_dtype": ["auto", "fp8"],
        "engine": {"async_scheduling": [True, False], "max_seq_len_to_capture": [1024]},
        "env": {"VLLM_CPU_KVCACHE_SPACE": ["4"]},
    },
    "objectives": [{"metric": "goodput_rps_per_device"}],
    "search": {"n_trials": 6, "seed": 1},
}
LENGTHS = [(100, 20), (300, 60), (64, 8), (2000, 200)]
LENGTHS_NAME = "lengths.jsonl"

CONTROL = ["\x00", "\n", "\r", "\t", "\x1b[31m", "\x7f", "\x85", "\u2028", "\u202e", "\x08", "\x0c"]
NASTY_TEXT = [
    "a\x00b",
    "a\nb",
    "a\rb",
    "\x1b[31mred\x1b[0m",
    "x\x7f",
    "\u202etp",
    "a\u2028b",
    "[/bold]",
    "$(touch PWNED)",
    "x;touch PWNED",
    "'",
    '"',
    "\\",
    "🙂",
    "é",
    " ",
    "",
]


@dataclass
class Mutant:
    """A serving spec to write (``data``) with the files beside it, and what must come of it."""

    data: dict
    files: dict[str, bytes] = field(default_factory=dict)  # name -> bytes, beside the spec
    special: dict[str, str] = field(default_factory=dict)  # name -> directory | fifo | symlink_loop | ...
    notes: list[tuple[str, str | None]] = field(default_factory=list)  # (label, error | ok | question | None)

    def note(self, label: str, expect: str | None = None) -> None:
        self.notes.append((label, expect))

    @property
    def expect(self) -> str | None:
        promises = [e for _, e in self.notes]
        if "error" in promises:
            return "error"
        return "ok" if promises and all(e == "ok" for e in promises) else None

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.notes]

    def promised(self, what: str) -> list[str]:
        return [label for label, e in self.notes if e == what]

    def spec_text(self) -> str:
        return yaml.safe_dump(self.data, allow_unicode=True, sort_keys=False, width=10_000)


def _pick(rng: random.Random, table: list[tuple]) -> tuple:
    return table[rng.randrange(len(table))]


def _traffic(m: Mutant) -> dict:
    return m.data["workload"]["traffic"]


# ------------------------------------------------------------------------------------- traffic
# (value, promise): "error" where the schema's own words refuse it, "question" where the answer is policy
TRAFFIC_VALUES: dict[str, list[tuple]] = {
    "rates": [
        ([1, 2, 8], "ok"),
        (3, "ok"),
        (0.5, "ok"),
        ([INF], "error"),
        ([1, INF], "error"),
        ([NAN], "error"),
        (INF, "error"),
        ([-1, 2], "error"),
        ([0], "error"),
        ([4, 2], "error"),
        ([1, 1], "error"),
        ([], "error"),
        ([1e300], "error"),
        ([2e6], "error"),
        ([1e-300], "question"),
        ([2**63], "error"),
        ([[1]], "error"),
        ({"low": 1, "high": 2}, "error"),
        (None, "error"),
        (["1", "2"], None),
        ([True], None),
        (list(range(1, 2001)), None),
        ("fast", "error"),
    ],
    "arrival": [("poisson", "ok"), ("uniform", "error"), ("POISSON", "error"), ("", "error"), (None, "error")],
    "burstiness": [
        (1, "ok"),
        (INF, "error"),
        (NAN, "error"),
        (-1, "error"),
        (0, "error"),
        (1e-300, "error"),
        (1e300, "error"),
        (0.001, "ok"),
        ("x", "error"),
    ],
    "shared_prefix": [(0, "ok"), (0.99, "ok"), (NAN, "error"), (INF, "error"), (1, "error"), (-0.1, "error")],
    "duration_s": [
        (1, "ok"),
        (INF, "error"),
        (-INF, "error"),
        (NAN, "error"),
        (0, "error"),
        (-1, "error"),
        (1e300, "error"),
        (86_401, "error"),
        (86_400, "ok"),
        (1e-300, None),
        ("10s", "error"),
    ],
    "warmup_requests": [(0, "ok"), (-1, "error"), (1.5, "error"), (2**63, "error"), (1e300, "error"), ("x", "error")],
    "seed": [(7, "ok"), (-1, "error"), (2**63, "error"), (1.5, "error"), (NAN, "error"), ("x", "error")],
}


def op_traffic(rng: random.Random, m: Mutant) -> None:
    traffic = _traffic(m)
    choice = rng.random()
    if choice < 0.08:
        key = rng.choice(["rate", "qps", "lengths", "prompt_lens", "Rates"])
        traffic[key] = rng.choice([1, [1], "x"])
        m.note(f"traffic:unknown-key:{key}", "error")
        return
    if choice < 0.14:
        key = rng.choice(["rates"])
        traffic.pop(key)
        m.note(f"traffic:delete:{key}", "error")
        return
    name = rng.choice(list(TRAFFIC_VALUES))
    value, expect = _pick(rng, TRAFFIC_VALUES[name])
    traffic[name] = copy.deepcopy(value)
    m.note(f"traffic:{name}={_short(value)}", expect)


# ------------------------------------------------------------------------------------- lengths
# a token written into one record of a JSON-lines file, as JSON text: (token, promise)
JSON_TOKENS = [
    ("12", "ok"),
    ("Infinity", "error"),
    ("-Infinity", "error"),
    ("NaN", "error"),
    ("1e300", "error"),
    ("1e20", "error"),
    ("18446744073709551616", "error"),
    ("9007199254740993", "error"),
    ("true", "error"),
    ("false", "error"),
    ("null", "error"),
    ("0", "error"),
    ("-5", "error"),
    ("[1]", "error"),
    ("{}", "error"),
    ('""', "error"),
    ('"x"', "error"),
    ('"12"', "question"),
    ("12.0", "question"),
    ("1.5", "question"),
    ("1e2", "question"),
    ("9" * 5000, "error"),
    ("1_000", "error"),
    ("0x10", "error"),
]
# a cell of a CSV file (every cell is text)
CSV_TOKENS = [
    ("12", "ok"),
    ('"12"', "ok"),
    ("inf", "error"),
    ("Infinity", "error"),
    ("nan", "error"),
    ("1e300", "error"),
    ("1e20", "error"),
    ("18446744073709551616", "error"),
    ("true", "error"),
    ("", "error"),
    ("0", "error"),
    ("-5", "error"),
    ("0x10", "error"),
    ("x", "error"),
    (" 12 ", "question"),
    ("+12", "question"),
    ("12.0", "question"),
    ("1_000", "question"),
    ("\u0661\u0662", "question"),  # Arabic-Indic digits: int() reads them as 12
    ("12\x00", "error"),
]


def _jsonl(pairs, fmt: str = '{{"prompt_len": {p}, "output_len": {o}}}') -> str:
    return "".join(fmt.format(p=p, o=o) + "\n" for p, o in pairs)


def _csv(pairs, header: str = "prompt_len,output_len") -> str:
    return header + "\n" + "".join(f"{p},{o}\n" for p, o in pairs)


def _reset_lengths(m: Mutant) -> None:
    """The base's prompt_len and output_len again, no lengths file (a mutant may start with one)."""
    traffic = _traffic(m)
    traffic.pop("lengths_file", None)
    traffic.pop("length_pairs", None)
    m.files.clear()
    for name in ("prompt_len", "output_len"):
        traffic[name] = copy.deepcopy(SERVE_BASE["workload"]["traffic"][name])


def _lengths_file(m: Mutant, name: str, content: bytes) -> None:
    traffic = _traffic(m)
    traffic.pop("prompt_len", None)
    traffic.pop("output_len", None)
    traffic["lengths_file"] = name
    m.files[name] = content


def op_lengths(rng: random.Random, m: Mutant) -> None:
    variant = rng.choices(
        ["range", "json_token", "csv_token", "json_shape", "csv_shape", "encoding", "path", "type", "pairs"],
        [2, 4, 3, 2, 2, 2, 3, 1, 2],
    )[0]
    _reset_lengths(m)
    traffic = _traffic(m)
    pairs = [list(p) for p in LENGTHS]
    if variant == "range":
        name = rng.choice(["prompt_len", "output_len"])
        value, expect = _pick(
            rng,
            [
                (1, "ok"),
                ({"low": 1, "high": 1}, "ok"),
                ({"low": 10, "high": 5}, "error"),
                ({"low": 0, "high": 5}, "error"),
                ({"low": 1}, "error"),
                ({"low": 1, "high": 2, "step": 1}, "error"),
                (0, "error"),
                (-1, "error"),
                (1.5, "error"),
                (INF, "error"),
                (NAN, "error"),
                (10**30, "error"),
                (2**53, "error"),
                (2**52, "question"),
                (True, None),
                ("64", None),
                ([64, 128], "error"),
                (None, "error"),
            ],
        )
        traffic[name] = copy.deepcopy(value)
        if rng.random() < 0.2:  # both lengths and a lengths file
            m.files[LENGTHS_NAME] = _jsonl(pairs).encode()
            traffic["lengths_file"] = LENGTHS_NAME
            m.note(f"lengths:{name}={_short(value)}+lengths_file", "error")
        else:
            m.note(f"lengths:{name}={_short(value)}", expect)
    elif variant in ("json_token", "csv_token"):
        tokens = JSON_TOKENS if variant == "json_token" else CSV_TOKENS
        token, expect = _pick(rng, tokens)
        row, col = rng.randrange(len(pairs)), rng.randrange(2)
        pairs[row][col] = token
        if variant == "json_token":
            text = _jsonl(pairs)
            name = rng.choice(["lengths.jsonl", "lengths.json", "lengths.txt", "lengths"])
        else:
            text = _csv(pairs)
            name = rng.choice(["lengths.csv", "LENGTHS.CSV"])
        _lengths_file(m, name, text.encode())
        m.note(f"lengths:{variant}:{token[:20]!r}", expect)
    elif variant == "json_shape":
        shape, text, expect = _pick(
            rng,
            [
                ("extra-key", _jsonl(pairs, '{{"prompt_len": {p}, "output_len": {o}, "id": "r"}}'), "ok"),
                ("blank-lines", "\n\n" + _jsonl(pairs).replace("\n", "\n  \n"), "ok"),
                ("crlf", _jsonl(pairs).replace("\n", "\r\n"), "ok"),
                ("no-final-newline", _jsonl(pairs).rstrip("\n"), "ok"),
                ("one-record", _jsonl(pairs[:1]), "ok"),
                ("duplicate-key", '{"prompt_len": 10, "prompt_len": 20, "output_len": 5}\n', "error"),
                ("array-record", "[100, 20]\n", "error"),
                ("number-record", "100\n", "error"),
                ("string-record", '"100,20"\n', "error"),
                ("json-array", json.dumps([{"prompt_len": p, "output_len": o} for p, o in pairs]) + "\n", None),
                ("missing-key", '{"prompt_len": 10}\n', "error"),
                ("wrong-key", '{"prompt": 10, "output": 5}\n', "error"),
                ("comment", "# lengths\n" + _jsonl(pairs), "error"),
                ("trailing-comma", '{"prompt_len": 10, "output_len": 5,}\n', "error"),
                ("empty", "", "error"),
                ("whitespace", "  \n\t\n", "error"),
                ("deep", "[" * 100_000 + "]" * 100_000 + "\n", "error"),
                ("deep-object", '{"a": ' * 50_000 + "1" + "}" * 50_000 + "\n", "error"),
                ("nul", '{"prompt_len": 10, "output_len": 5}\x00\n', "error"),
                ("too-many", _jsonl([(1, 1)] * 100_001), "error"),
                ("long-line", " " * 2_000_000 + '{"prompt_len": 10, "output_len": 5}\n', None),
            ],
        )
        if shape in ("too-many", "long-line") and rng.random() < 0.8:  # seconds to write and read: rarely
            shape, text, expect = "one-record", _jsonl(pairs[:1]), "ok"
        _lengths_file(m, "lengths.jsonl", text.encode())
        m.note(f"lengths:json_shape:{shape}", expect)
    elif variant == "csv_shape":
        body = "".join(f"{p},{o}\n" for p, o in pairs)
        shape, text, expect = _pick(
            rng,
            [
                ("duplicate-column", "prompt_len,output_len,prompt_len\n10,5,20\n", "error"),
                ("duplicate-output", "prompt_len,output_len,output_len\n10,5,0\n", "error"),
                ("missing-column", "prompt_len\n10\n", "error"),
                ("extra-column", "prompt_len,output_len,id\n" + "".join(f"{p},{o},r\n" for p, o in pairs), "ok"),
                ("reordered", "output_len,prompt_len\n" + "".join(f"{o},{p}\n" for p, o in pairs), "ok"),
                ("spaced-header", " prompt_len , output_len\n" + body, "question"),
                ("upper-header", "PROMPT_LEN,OUTPUT_LEN\n" + body, "question"),
                ("semicolons", "prompt_len;output_len\n10;5\n", "error"),
                ("quoted", '"prompt_len","output_len"\n"10","5"\n', "ok"),
                ("short-row", "prompt_len,output_len\n10\n", "error"),
                ("long-row", "prompt_len,output_len\n10,5,7\n", "error"),
                ("blank-lines", "prompt_len,output_len\n\n10,5\n\n", "ok"),
                ("header-only", "prompt_len,output_len\n", "error"),
                ("crlf", _csv(pairs).replace("\n", "\r\n"), "ok"),
                ("empty", "", "error"),
                ("no-header", body, "error"),
                ("quoted-newline", 'prompt_len,output_len\n"10\n",5\n', None),
                ("unclosed-quote", 'prompt_len,output_len\n"10,5\n', "error"),
                ("nul", "prompt_len,output_len\n10,5\x00\n", "error"),
                ("tsv", "prompt_len\toutput_len\n10\t5\n", "error"),
            ],
        )
        _lengths_file(m, "lengths.csv", text.encode())
        m.note(f"lengths:csv_shape:{shape}", expect)
    elif variant == "encoding":
        csv_file = rng.random() < 0.4
        if csv_file:
            text = "prompt_len,output_len,note\n" + "".join(f"{p},{o},café\n" for p, o in pairs)
        else:
            text = _jsonl(pairs, '{{"prompt_len": {p}, "output_len": {o}, "note": "café"}}')
        codec, expect = _pick(
            rng,
            [
                ("utf-8", "ok"),
                ("utf-8-sig", "ok"),
                ("utf-16", None),
                ("utf-16-le", None),
                ("utf-32", None),
                ("latin-1", None),
                ("invalid-byte", None),
                ("surrogate", "error"),
                ("binary", "error"),
                ("gzip", "error"),
            ],
        )
        if codec == "invalid-byte":
            raw = text.encode().replace("é".encode(), b"\xff", 1)
        elif codec == "surrogate":
            raw = text.encode() + b"\xed\xa0\x80\n"
        elif codec == "binary":
            raw = rng.randbytes(rng.choice([1, 16, 4096]))
        elif codec == "gzip":
            import gzip

            raw = gzip.compress(text.encode())
        else:
            raw = text.encode(codec)
        _lengths_file(m, "lengths.csv" if csv_file else "lengths.jsonl", raw)
        m.note(f"lengths:encoding:{'csv' if csv_file else 'jsonl'}:{codec}", expect)
    elif variant == "path":
        good = _jsonl(pairs).encode()
        which, expect = _pick(
            rng,
            [
                ("missing", "error"),
                ("directory", "error"),
                ("fifo", "error"),
                ("dev_zero", "error"),
                ("dev_null", "error"),
                ("proc", "error"),
                ("symlink_loop", "error"),
                ("dangling_symlink", "error"),
                ("symlink_to_fifo", "error"),
                ("symlink_to_file", "ok"),
                ("empty_name", "error"),
                ("nul_in_name", "error"),
                ("newline_in_name", None),
                ("control_in_name", None),
                ("name_too_long", "error"),
                ("path_too_long", "error"),
                ("url", "error"),
                ("tilde", "error"),
                ("the_spec_itself", "error"),
                ("absolute", "ok"),
                ("dot_dot", "error"),
            ],
        )
        traffic.pop("prompt_len", None)
        traffic.pop("output_len", None)
        name = {
            "dev_zero": "/dev/zero",
            "dev_null": "/dev/null",
            "proc": "/proc/self/status",
            "empty_name": "",
            "nul_in_name": "len\x00gths.jsonl",
            "newline_in_name": "len\ngths.jsonl",
            "control_in_name": "len\x1b[31mgths.jsonl",
            "name_too_long": "n" * 300 + ".jsonl",
            "path_too_long": "/".join(["d" * 200] * 25) + "/x.jsonl",
            "url": "https://example.com/lengths.jsonl",
            "tilde": "~/lengths.jsonl",
            "the_spec_itself": "spec.yaml",
            "absolute": "{dir}/lengths.jsonl",
            "dot_dot": "../no-such-dir/lengths.jsonl",
        }.get(which, "lengths.jsonl")
        traffic["lengths_file"] = name
        if which in ("directory", "fifo", "symlink_loop", "dangling_symlink", "symlink_to_fifo"):
            m.special[name] = which
        elif which == "symlink_to_file":
            m.files["real.jsonl"] = good
            m.special[name] = "symlink_to:real.jsonl"
        elif which in ("newline_in_name", "control_in_name", "absolute"):
            m.files["lengths.jsonl" if which == "absolute" else name] = good
        m.note(f"lengths:path:{which}", expect)
    elif variant == "type":
        value, expect = _pick(rng, [(5, "error"), (["a.jsonl"], "error"), ({"a": 1}, "error"), (True, "error")])
        traffic.pop("prompt_len", None)
        traffic.pop("output_len", None)
        traffic["lengths_file"] = copy.deepcopy(value)
        m.note(f"lengths:lengths_file={_short(value)}", expect)
    else:  # user-written length_pairs
        value, expect = _pick(
            rng,
            [
                ([[100, 20]], "error"),  # filled by the loader from lengths_file, never written
                ([[100, 20], [300, 60]], "error"),
                ([], "error"),
                ([[0, 0]], "error"),
                ([[-1, 5]], "error"),
                ([[1, 2, 3]], "error"),
                ([[INF, 1]], "error"),
                ([[NAN, 1]], "error"),
                ([[1e300, 1]], "error"),
                ([[2**53, 1]], "error"),
                ([[True, 1]], "error"),
                ([["a", 1]], "error"),
                ([[None, 1]], "error"),
                ([100, 20], "error"),
                ({"prompt_len": 1, "output_len": 2}, "error"),
                ([[1, 1]] * 100_001, "error"),
            ],
        )
        with_what = rng.choice(["alone", "alone", "lengths", "file"])
        if with_what == "alone":
            traffic.pop("prompt_len", None)
            traffic.pop("output_len", None)
        elif with_what == "file":  # pairs given and a file: which one is measured?
            _lengths_file(m, LENGTHS_NAME, _jsonl(pairs).encode())
        traffic["length_pairs"] = copy.deepcopy(value)
        m.note(f"lengths:length_pairs={_short(value)}:{with_what}", expect)


# ----------------------------------------------------------------------------------------- slo
def op_slo(rng: random.Random, m: Mutant) -> None:
    slo = m.data["workload"]["slo"]
    name = rng.choice(["ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms", "unknown", "delete"])
    if name == "unknown":
        key = rng.choice(["ttft_p50_ms", "TTFT_P99_MS", "ttft", "goodput"])
        slo[key] = 100
        m.note(f"slo:unknown:{key}", "error")
        return
    if name == "delete":
        slo.pop("ttft_p99_ms")
        m.note("slo:delete:ttft_p99_ms", "error")
        return
    value, expect = _pick(
        rng,
        [
            (50, "ok"),
            (0.001, "ok"),
            (INF, "error"),
            (-INF, "error"),
            (NAN, "error"),
            (0, "error"),
            (-1, "error"),
            (1e300, "error"),
            (86_400_000, "ok"),
            (1e-300, None),
            ("100ms", "error"),
            ([100], "error"),
            (None, "error" if name == "ttft_p99_ms" else "ok"),
            (2**63, "error"),
        ],
    )
    slo[name] = value
    m.note(f"slo:{name}={_short(value)}", expect)


# -------------------------------------------------------------------------------------- engine
ENGINE_NAMES = [
    ("max_num_partial_prefills", "ok"),
    ("maxIterTimes", None),  # MindIE's spelling: refused with target vllm
    ("_x", "ok"),
    ("--enforce-eager", "error"),
    ("-O", "error"),
    ("enforce-eager", "error"),
    ("a b", "error"),
    ("a\x00b", "error"),
    ("a\nb", "error"),
    ("\x1b[31m", "error"),
    ("🙂", "error"),
    ("é", "error"),
    ("", "error"),
    ("1abc", "error"),
    ("a=b", "error"),
    ("$(x)", "error"),
    ("a" * 300, None),
]
ENGINE_VALUES = [
    ([True], None),
    ([1, 2], None),
    (["x"], None),
    ([0.5], None),
    ([], "error"),
    ([None], "error"),
    ([[1]], "error"),
    ([{}], "error"),
    ([NAN], "error"),
    ([INF], "error"),
    ([-INF], "error"),
    ([1, NAN], "error"),
    ([2**63], "error"),
    (["a\x00b"], "error"),
    (["\x00"], "error"),
    (["a\nb"], "error"),
    (["a\rb"], "error"),
    (["\x1b[31mred"], "error"),
    (["x\x7f"], "error"),
    (["a\tb"], "error"),
    (["a\u2028b"], "question"),
    (["\u202eevil"], "question"),
    (["--enforce-eager"], "error"),  # after --NAME, vLLM's parser reads it as a flag of its own
    (["--port=1"], "error"),
    (["-O3"], "error"),
    (["-"], "error"),
    (["-1"], "error"),
    (["x --model=/etc/passwd"], None),
    ([-1], None),
    (["x" * 200_000], "question"),
    ([1, 1], "question"),
    ([True, "true"], None),
    (["$(touch PWNED)"], None),
    (["{trial_file}"], None),
    ([""], None),
    ([1e300], None),
    (1, "error"),
    ("x", "error"),
    (None, "error"),
    ({"low": 1, "high": 4}, "error"),
]


def op_engine(rng: random.Random, m: Mutant) -> None:
    space = m.data["space"]
    choice = rng.random()
    if choice < 0.08:
        value, expect = _pick(rng, [([1], "error"), (None, "error"), ({}, "ok"), ("x", "error")])
        space["engine"] = copy.deepcopy(value)
        m.note(f"engine:engine={_short(value)}", expect)
        return
    if choice < 0.5:
        name, expect = _pick(rng, ENGINE_NAMES)
        value = copy.deepcopy(rng.choice([[True], [1, 2], ["x"]]))
        space["engine"][name] = value
        m.note(f"engine:name={name[:24]!r}", expect)
        return
    value, expect = _pick(rng, ENGINE_VALUES)
    name = rng.choice(["async_scheduling", "max_seq_len_to_capture", "maxIterTimes", "served_model_name"])
    space["engine"][name] = copy.deepcopy(value)
    m.note(f"engine:value={_short(value)}", expect)


# ----------------------------------------------------------------------------------------- env
ENV_VALUES = [
    (["1"], "ok"),
    ([True, False], "ok"),
    ([1, 2], "ok"),
    ([NAN], "error"),
    ([INF], "error"),
    ([-INF], "error"),
    (["1", NAN], "error"),
    (["nan"], None),
    (["inf"], None),
    (["a\x00b"], "error"),
    (["a\nb"], "error"),
    (["\x1b[31m"], "error"),
    (["a\u2028b"], "question"),
    (["--flag"], None),
    ([None], "error"),
    ([], "error"),
    ([[1]], "error"),
    ([{}], "error"),
    ([2**63], "error"),
    ([1e300], None),
    (["x" * 200_000], "error"),
    ([1, "1"], "question"),
]


def op_env(rng: random.Random, m: Mutant) -> None:
    where = rng.choice(["space", "space", "backend", "baseline"])
    if where == "space":
        name, name_expect = _pick(
            rng,
            [
                ("VLLM_CPU_KVCACHE_SPACE", None),
                ("PYTORCH_CUDA_ALLOC_CONF", None),
                ("HCCL_BUFFSIZE", None),
                ("MY_VAR", None),
                ("1BAD", "error"),
                ("A-B", "error"),
                ("X=1;touch PWNED;#", "error"),
                ("A\x00B", "error"),
            ],
        )
        value, expect = _pick(rng, ENV_VALUES)
        if name in ("PYTORCH_CUDA_ALLOC_CONF", "HCCL_BUFFSIZE") and expect == "ok":
            expect = None
        m.data["space"]["env"][name] = copy.deepcopy(value)
        m.note(f"env:space:{name}={_short(value)}", name_expect or expect)
    elif where == "backend":
        value, expect = _pick(
            rng,
            [
                ("1", "ok"),
                ("", "ok"),
                (NAN, "error"),
                (INF, "error"),
                (1, None),
                (True, None),
                (None, "error"),
                ("a\x00b", "error"),
                ("a\nb", "question"),
                ([1], "error"),
            ],
        )
        m.data["backend"]["env"]["VLLM_X"] = value
        m.note(f"env:backend={_short(value)}", expect)
    else:
        value, expect = _pick(rng, [("4", None), (NAN, "error"), (INF, "error"), ("5", "error"), ("a\x00b", "error")])
        m.data["baseline"] = {"tp": 1, "replicas": 1, "env.VLLM_CPU_KVCACHE_SPACE": value}
        m.note(f"env:baseline={_short(value)}", expect)


# --------------------------------------------------------------------------------------- space
SPACE_VALUES: dict[str, list[tuple]] = {
    "replicas": [([1, 4], "ok"), ({"low": 1, "high": 4}, "ok"), ([0], "error"), ([-1], "error"), ([], "error")],
    "max_num_seqs": [([1], "ok"), ([1, 1], "error"), ([2**63], "error"), ({"low": 1, "high": 10**6}, None)],
    "max_num_batched_tokens": [([4096], "ok"), ([0], "error"), ([1.5], "error"), ([INF], "error"), ([NAN], "error")],
    "memory_utilization": [
        ([0.9], "ok"),
        ([1], "ok"),
        ([NAN], "error"),
        ([INF], "error"),
        ([0], "error"),
        ([1.5], "error"),
        ([-0.5], "error"),
        ([1e-300], None),
    ],
    "block_size": [([16, 32], "ok"), ([8], "error"), ([16, 16], "error"), ([NAN], "error")],
    "graph_mode": [(["eager"], None), (["torchair"], None), (["GRAPH"], "error"), ([None], "error")],
    "enable_prefix_caching": [([True, False], "ok"), (["yes"], None), ([2], "error")],
    "kv_cache_dtype": [(["int8"], None), (["fp4"], "error"), ([], "error")],
    "quantization": [(["w8a8"], None), (["none"], None), (["gptq"], "error")],
    "precision": [(["fp32"], None), (["bf16", "fp16"], None), (["fp64"], "error")],
    "micro_batch_size": [([1, 2], "error")],
    "recompute": [(["full"], "error")],
    "zero_stage": [([0], "error")],
    "batch_size": [([1, 4], "error")],
    "tp": [([1, 2, 4], None), ([3], "error"), ([0], "error"), ({"low": 1, "high": 2**40}, "error")],
    "pp": [([1, 2], None), ([8], "error")],
}


def op_space(rng: random.Random, m: Mutant) -> None:
    name = rng.choice(list(SPACE_VALUES))
    value, expect = _pick(rng, SPACE_VALUES[name])
    m.data["space"][name] = copy.deepcopy(value)
    m.note(f"space:{name}={_short(value)}", expect)


# ------------------------------------------------------------------------------------ workload
WORKLOAD_VALUES: dict[str, list[tuple]] = {
    "batch_sweep": [
        ([], "ok"),
        ([1, 16], "ok"),
        ([0], "error"),
        ([-1], "error"),
        ([2**63], "error"),
        ([1, 1], "question"),
        (["x"], "error"),
        ([1.5], "error"),
        (5, "error"),
        ([10**6], "question"),
    ],
    "max_model_len": [
        (1, "error"),
        (0, "error"),
        (4096, "ok"),
        (2**52, "question"),
        (2**63, "error"),
        (NAN, "error"),
        ("x", "error"),
    ],
    "startup_timeout_s": [(1, "ok"), (INF, "error"), (NAN, "error"), (0, "error"), (1e300, "error"), (86_401, "error")],
    "timeout_s": [
        (60, "ok"),
        (INF, "error"),
        (-INF, "error"),
        (NAN, "error"),
        (-1, "error"),
        (7 * 86_400 + 1, "error"),
    ],
    "kind": [("train", "error"), ("infer", "error"), ("Serve", "error"), (None, "error")],
    "traffic": [(None, "error"), ([], "error"), ({}, "error")],
    "slo": [(None, "error"), ({}, "error")],
    "seq_len": [(128, "error")],
}


def op_workload(rng: random.Random, m: Mutant) -> None:
    name = rng.choice(list(WORKLOAD_VALUES))
    value, expect = _pick(rng, WORKLOAD_VALUES[name])
    m.data["workload"][name] = copy.deepcopy(value)
    m.note(f"workload:{name}={_short(value)}", expect)


# --------------------------------------------------------------------------------------- stack
def op_stack(rng: random.Random, m: Mutant) -> None:
    what = rng.choice(["target", "backend", "args", "cluster"])
    if what == "target":
        value, expect = _pick(
            rng, [("none", "ok"), ("mindie", None), ("megatron", "error"), ("sglang", "error"), (None, None)]
        )
        m.data["target"] = value
    elif what == "backend":
        value, expect = _pick(
            rng,
            [
                ("vllm", None),
                ("mindie", None),
                ("torch", None),
                ("command", "error"),
                ("megatron", "error"),
                ("auto", None),
                ("VLLM", "error"),
            ],
        )
        m.data["backend"]["kind"] = value
    elif what == "args":
        value, expect = _pick(
            rng,
            [
                (["--trust-remote-code"], None),
                (["--max-model-len", "10"], "error"),
                (["--max-num-seqs=4"], "error"),
                (["--enforce-eager"], "error"),
                (["--a\x00b"], "error"),  # no command line holds a NUL
                (["a\nb"], "question"),
                ([1], "error"),
            ],
        )
        m.data["backend"]["kind"] = "vllm"
        m.data["backend"]["args"] = value
    else:
        name = rng.choice(["devices_per_node", "nodes", "accelerator", "cost_per_device_hour", "profile"])
        value, expect = _pick(
            rng,
            {
                "devices_per_node": [(1, None), (0, "error"), (2**63, "error"), (1024, None), (NAN, "error")],
                "nodes": [(2, None), (0, "error")],
                "accelerator": [("cuda", None), ("npu", None), ("tpu", "error")],
                "cost_per_device_hour": [(NAN, "error"), (INF, "question"), (-1, "error"), (0, None)],
                "profile": [("no-such-profile", "error"), ("", "question"), ("a\x00b", "error"), (None, None)],
            }[name],
        )
        m.data["cluster"][name] = value
        what = f"cluster.{name}"
    m.note(f"stack:{what}={_short(value)}", expect)


# ---------------------------------------------------------------------------------------- data
ANY_SCALAR = [None, True, False, 0, 1, -1, 2, 2**31, 2**53, 2**63, 1.5, -0.0, NAN, INF, -INF, 1e300, "1", "auto"]
ANY_SCALAR += NASTY_TEXT


def _random_value(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if depth < 2 and pick < 0.12:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 2 and pick < 0.2:
        return {rng.choice(["low", "high", "x", "rates", "engine"]): _random_value(rng, depth + 1)}
    return rng.choice(ANY_SCALAR)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, prefix + (i,))


SERVE_PATHS = [p for p in _paths(SERVE_BASE) if p]


def op_data(rng: random.Random, m: Mutant) -> None:
    path = rng.choice(SERVE_PATHS)
    parent = m.data
    try:
        for part in path[:-1]:
            parent = parent[part]
    except (KeyError, IndexError, TypeError):
        return
    if not isinstance(parent, (dict, list)):
        return
    action = rng.choice(["replace", "delete", "add"])
    if action == "delete" and isinstance(parent, dict):
        parent.pop(path[-1], None)
        m.note(f"data:delete:{'.'.join(map(str, path))}")
    elif action == "add" and isinstance(parent, dict):
        parent[rng.choice(["x", "low", "high", "rates", "engine", "env", "lengths_file", "length_pairs"])] = (
            _random_value(rng)
        )
        m.note(f"data:add:{'.'.join(map(str, path[:-1]))}")
    else:
        try:
            parent[path[-1]] = _random_value(rng)
        except (IndexError, TypeError):
            return
        m.note(f"data:replace:{'.'.join(map(str, path))}")


AREAS = {
    "traffic": (op_traffic, 3),
    "lengths": (op_lengths, 6),
    "slo": (op_slo, 2),
    "engine": (op_engine, 5),
    "env": (op_env, 3),
    "space": (op_space, 2),
    "workload": (op_workload, 2),
    "stack": (op_stack, 2),
    "data": (op_data, 3),
}


def serving_mutant(rng: random.Random) -> Mutant:
    """One serving mutant: one or two mutations, of different areas (their promises are then
    independent of each other)."""
    m = Mutant(copy.deepcopy(SERVE_BASE))
    if rng.random() < 0.3:  # the lengths from a file from the start
        _lengths_file(m, LENGTHS_NAME, _jsonl(LENGTHS).encode())
    names = list(AREAS)
    weights = [AREAS[n][1] for n in names]
    count = 1 if rng.random() < 0.7 else 2
    chosen: list[str] = []
    while len(chosen) < count and "data" not in chosen:  # "data" alone: it may delete any section
        area = rng.choices(names, weights)[0]
        if area not in chosen and not (area == "data" and chosen):
            chosen.append(area)
    for area in chosen:
        try:
            AREAS[area][0](rng, m)
        except (KeyError, TypeError, AttributeError, IndexError):  # the first mutation replaced the section
            m.note(f"{area}:not-applied")
    if not m.notes:
        m.note("unchanged", "ok")
    return m


def write_mutant(m: Mutant, work) -> str:
    """The mutant's files under ``work`` (a directory, a ``Path``); the spec's path."""
    directory = str(work)
    traffic = m.data.get("workload", {}).get("traffic") if isinstance(m.data.get("workload"), dict) else None
    if isinstance(traffic, dict) and isinstance(traffic.get("lengths_file"), str):
        traffic["lengths_file"] = traffic["lengths_file"].replace("{dir}", directory)
    for name, raw in m.files.items():
        (work / name).write_bytes(raw)
    for name, which in m.special.items():
        make_special(work / name, which)
    path = work / "spec.yaml"
    path.write_text(m.spec_text(), encoding="utf-8")
    return str(path)


def make_special(path, which: str) -> None:
    """A lengths file that is not a regular file: a directory, a FIFO, a symlink loop..."""
    import os

    if which == "directory":
        path.mkdir()
    elif which == "fifo":
        os.mkfifo(path)
    elif which == "symlink_loop":
        path.symlink_to(path)
    elif which == "dangling_symlink":
        path.symlink_to(path.parent / "nowhere.jsonl")
    elif which == "symlink_to_fifo":
        os.mkfifo(path.parent / "the-fifo")
        path.symlink_to(path.parent / "the-fifo")
    elif which.startswith("symlink_to:"):
        path.symlink_to(path.parent / which.split(":", 1)[1])
    else:
        raise ValueError(which)


def _short(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} chars)"
