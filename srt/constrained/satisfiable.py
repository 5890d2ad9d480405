"""Static checks of a constraint's text that the grammar libraries do not make: nesting depth, and whether the
grammar admits any complete output at all.

Why: a `$ref` cycle with no base case (`{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}`) or a
GBNF rule that only ever refers back to itself (`root ::= ("a" | "b") root`) compiles in llguidance and
xgrammar, and its first masks even allow tokens, but no output can ever complete it: the request would run to
its token limit, or (llguidance) stop at once with an empty "match". Both are a 400 instead. The check is the
least fixpoint of "can produce a finite value/string" over the schema's `$ref` targets or the grammar's
rules: a ref or rule is productive when some way through it uses only productive parts.

Where the text uses something this module does not model (a remote `$ref`, an unknown GBNF token) it answers
"satisfiable" and leaves the verdict to the library: a false 400 would refuse a valid constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from srt.constrained.base_backend import EBNF, JSON_SCHEMA, GrammarError, GrammarKey

# Deepest nesting of brackets a JSON-schema text may have. serde_json (inside llguidance) refuses deeper
# documents at 128, and Python's own json module raises RecursionError (a 500) near 1,000: the depth is
# checked by a scan that does not recurse, before anything parses the text.
MAX_JSON_NESTING = 128
# Most `$ref` targets or GBNF rules analysed; beyond, the library's verdict alone counts.
MAX_SYMBOLS = 10_000


def json_nesting_depth(text: str) -> int:
    """Deepest `[`/`{` nesting of a JSON text (brackets inside strings ignored), without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_json_nesting(text: str) -> None:
    """ValueError when `text` nests deeper than MAX_JSON_NESTING."""
    depth = json_nesting_depth(text)
    if depth > MAX_JSON_NESTING:
        raise ValueError(f"nests {depth} levels deep; at most {MAX_JSON_NESTING} are accepted")


def check_satisfiable(key: GrammarKey) -> None:
    """GrammarError when the constraint provably admits no complete output."""
    if key.kind == JSON_SCHEMA:
        check_json_nesting_as_grammar(key)
        problem = unproductive_schema(json.loads(key.spec))
    elif key.kind == EBNF:
        problem = unproductive_gbnf(key.spec)
    else:
        problem = None  # a regex has no recursion; an empty class is the library's to find
    if problem:
        raise GrammarError(f"the {key.kind} admits no complete output: {problem}", key.kind)


def check_json_nesting_as_grammar(key: GrammarKey) -> None:
    try:
        check_json_nesting(key.spec)
    except ValueError as e:
        raise GrammarError(f"the {key.kind} {e}", key.kind) from e


# ---- JSON schema ----
ROOT_REF = "#"


def _resolve(root: Any, ref: str) -> tuple[bool, Any]:
    """(found, schema) of a local `$ref` ("#" or a JSON pointer "#/a/b"); (False, None) for anything else."""
    if ref == ROOT_REF:
        return True, root
    if not ref.startswith("#/"):
        return False, None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


class _SchemaProductivity:
    """Whether a schema can be instantiated by a finite JSON value, given what is known of each `$ref`."""

    def __init__(self, root: Any):
        self.root = root
        self.known: dict[str, bool] = {}  # ref -> productive (False until shown otherwise)
        self.referenced: set[str] = set()  # the refs the schema uses (the root is evaluated as one too)

    def productive(self, s: Any) -> bool:
        if s is False:
            return False
        if not isinstance(s, dict):
            return True
        ok = True
        ref = s.get("$ref")
        if isinstance(ref, str):
            found, _ = _resolve(self.root, ref)
            if found:
                self.referenced.add(ref)
                self.known.setdefault(ref, False)
                ok = self.known[ref]
        for name, combine in (("allOf", all), ("anyOf", any), ("oneOf", any)):
            parts = s.get(name)
            if isinstance(parts, list):
                ok = ok and combine(self.productive(p) for p in parts)
        return ok and self._typed(s)

    def _typed(self, s: dict) -> bool:
        types = s.get("type")
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types:
            return True  # untyped: some scalar instance exists whatever `required` or `items` say
        return any(self._type_ok(t, s) for t in types)

    def _type_ok(self, t: Any, s: dict) -> bool:
        if t == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            extra = s.get("additionalProperties", True)
            required = s.get("required") if isinstance(s.get("required"), list) else []
            return all(
                self.productive(props[r] if r in props else extra) for r in required if isinstance(r, str)
            )
        if t == "array":
            need = s.get("minItems", 0)
            if not isinstance(need, int) or need <= 0:
                return True
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
            if not all(self.productive(p) for p in prefix[:need]):
                return False
            return need <= len(prefix) or self.productive(s.get("items", True))
        return True

    def solve(self) -> str | None:
        """None when the root is productive, else what is wrong (for the 400's message)."""
        # The root is a ref too ("#"), re-evaluated with the others: an evaluation stops at the first part
        # that decides it, so a ref behind a part not yet known productive is found in a later round.
        self.known[ROOT_REF] = False
        changed = True
        while changed and len(self.known) <= MAX_SYMBOLS:
            # until nothing flips and no new ref turns up (a ref found this round is evaluated next round)
            seen = len(self.known)
            changed = False
            for ref in list(self.known):
                if not self.known[ref] and self.productive(_resolve(self.root, ref)[1]):
                    self.known[ref] = changed = True
            changed = changed or len(self.known) != seen
        if len(self.known) > MAX_SYMBOLS or self.known[ROOT_REF]:
            return None
        # the root itself is named only where the schema refers to it ("#"), and after any other stuck ref
        stuck = sorted(ref for ref, ok in self.known.items() if not ok and ref != ROOT_REF)
        stuck += [ROOT_REF] if ROOT_REF in self.referenced else []
        if stuck:
            return f"`$ref` {stuck[0]} can only be satisfied through itself (a cycle with no base case)"
        return "no finite JSON value satisfies it"


def unproductive_schema(schema: Any) -> str | None:
    try:
        return _SchemaProductivity(schema).solve()
    except RecursionError:
        return None  # deeper than the nesting check lets through: not reached in practice


# ---- GBNF ----
_GBNF_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<name>[A-Za-z0-9_.-]+)
  | (?P<punct>[()|*+?])
  | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
    """,
    re.VERBOSE | re.DOTALL,
)


def _gbnf_tokens(text: str) -> list[tuple[str, str]] | None:
    """(kind, text) tokens of a GBNF grammar, or None at anything unrecognised."""
    out, pos = [], 0
    while pos < len(text):
        m = _GBNF_TOKEN.match(text, pos)
        if m is None:
            return None
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


class _GbnfParser:
    """A rule body as a closure over the `known` map: `seq(alt) := items`, `item := atom postfix*`."""

    def __init__(self, tokens: list[tuple[str, str]], known: dict[str, bool]):
        self.tokens = tokens
        self.pos = 0
        self.known = known

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def alternatives(self) -> Callable[[], bool]:
        seqs = [self.sequence()]
        while self.peek() == ("punct", "|"):
            self.pos += 1
            seqs.append(self.sequence())
        return lambda: any(s() for s in seqs)

    def sequence(self) -> Callable[[], bool]:
        items = []
        while (tok := self.peek()) is not None and tok not in (("punct", "|"), ("punct", ")")):
            items.append(self.item())
        return lambda: all(i() for i in items)

    def item(self) -> Callable[[], bool]:
        kind, text = self.tokens[self.pos]
        self.pos += 1
        if kind == "name":
            known = self.known

            def atom() -> bool:
                return known.get(text, True)  # an undefined rule is the library's error to report

        elif kind in ("string", "cls"):

            def atom() -> bool:
                return True

        elif (kind, text) == ("punct", "("):
            atom = self.alternatives()
            if self.peek() != ("punct", ")"):
                raise ValueError("unbalanced parenthesis")
            self.pos += 1
        else:
            raise ValueError(f"unexpected {text!r}")
        optional = False
        while (tok := self.peek()) is not None and (tok[0] == "repeat" or tok[1] in ("*", "+", "?")):
            self.pos += 1
            least = tok[1] if tok[0] != "repeat" else tok[1].strip("{} ").split(",")[0].strip()
            optional = optional or least in ("*", "?", "0")
        return (lambda: True) if optional else atom


def unproductive_gbnf(text: str) -> str | None:
    tokens = _gbnf_tokens(text)
    if tokens is None:
        return None
    starts = [i for i in range(len(tokens) - 1) if tokens[i][0] == "name" and tokens[i + 1][0] == "define"]
    if not starts or starts[0] != 0 or len(starts) > MAX_SYMBOLS:
        return None
    known: dict[str, bool] = {tokens[i][1]: False for i in starts}
    rules: dict[str, list[Callable[[], bool]]] = {}
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(tokens)
        parser = _GbnfParser(tokens[i + 2 : end], known)
        try:
            body = parser.alternatives()
        except (ValueError, IndexError):
            return None
        if parser.pos != len(parser.tokens):
            return None  # a stray token: not a grammar this parser understands
        rules.setdefault(tokens[i][1], []).append(body)
    changed = True
    while changed:
        changed = False
        for name, bodies in rules.items():
            if not known[name] and any(b() for b in bodies):
                known[name] = changed = True
    if "root" not in known or known["root"]:
        return None
    return "rule `root` can never finish (each way through it needs a rule that only ever leads back)"
