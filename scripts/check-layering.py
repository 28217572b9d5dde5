#!/usr/bin/env python3
"""Checks that the file-level module graph of a Rust crate has no circles.

Usage: check-layering.py SRC_DIR [SRC_DIR ...]
       check-layering.py --edges SRC_DIR [SRC_DIR ...]
       check-layering.py --self-test

An edge A -> B means code in file A names something in file B through a path: a `use`
declaration (`use crate::a::b`, `use super::x`, `use self::x`, brace groups, a child
module's name) or a path inside code (`crate::san::STASH_ENV`, `super::lock(...)`, or
`io::settle(...)` after `use super::io`). Each path goes to the file of the deepest
module that exists (`a/b.rs`, `a/b/mod.rs`, else `a.rs`; an inline `mod` counts as part of
its file). A `mod x;` declaration is no edge: a parent owning a child is the layering, a
child naming its parent's items is the arrow that matters. Comments and literals are
ignored, and so is code compiled only for tests: an item, statement, match arm, enum variant
or field under `#[cfg(test)]` or `#[cfg(all(test, ...))]` (exactly that element, to the end
of its block or to its `,` or `;`), a file with `#![cfg(test)]` and the files of a test-only
`mod x;`. Other predicates naming `test` (`any(test, ...)`, `not(test)`) keep their code.

A circle (strongly connected component of two or more files) is reported with, for each
edge inside it, the names that tie the two files; the exit status is then 1.
"""

import os
import re
import sys
import tempfile

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_literals(text):
    """Replaces comments, strings and char literals by spaces (newlines kept)."""
    out = []
    i = 0
    n = len(text)

    def blank(chunk):
        return "".join("\n" if c == "\n" else " " for c in chunk)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(blank(text[i:end]))
            i = end
        elif text.startswith("/*", i):
            depth = 0
            j = i
            while j < n:
                if text.startswith("/*", j):
                    depth += 1
                    j += 2
                elif text.startswith("*/", j):
                    depth -= 1
                    j += 2
                    if depth == 0:
                        break
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif (
            re.match(r'(?:b|c)?r#*"', text[i:i + 260])
            and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))
        ):
            m = re.match(r'(?:b|c)?r(#*)"', text[i:])
            close = '"' + m.group(1)
            end = text.find(close, i + m.end())
            end = n if end < 0 else end + len(close)
            out.append(blank(text[i:end]))
            i = end
        elif c == '"' or (
            c in "bc"
            and text.startswith('"', i + 1)
            and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))
        ):
            j = i + (1 if c == '"' else 2)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            end = min(j + 1, n)
            out.append(blank(text[i:end]))
            i = end
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}', '"') or a lifetime ('a, 'static).
            if text.startswith("\\", i + 1):
                j = i + 2
                while j < n and text[j] != "'":
                    j += 2 if text[j] == "\\" else 1
                out.append(blank(text[i:j + 1]))
                i = j + 1
            elif i + 2 < n and text[i + 2] == "'":
                out.append("   ")
                i += 3
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(text, open_at):
    """The index just past the `}` closing the `{` at `open_at`."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


CLOSER = {"(": ")", "[": "]", "{": "}"}


def skip_group(text, open_at):
    """The index just past the bracket closing the `(`, `[` or `{` at `open_at` (the three
    kinds nest inside one another; a stray closer of another kind ends the search)."""
    stack = []
    for j in range(open_at, len(text)):
        c = text[j]
        if c in CLOSER:
            stack.append(CLOSER[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                return j + 1
            if not stack:
                return j + 1
    return len(text)


def skip_generics(text, open_at):
    """The index just past the `>` closing generic arguments opened by the `<` at `open_at`,
    or None when that `<` is not one. Rustfmt writes `Vec<u8>` and `f::<T>` with the `<`
    right after a name and `a < b` with spaces, and generic arguments hold no `{`, `}`,
    `.`, `|` nor a `;` outside brackets (`[T; N]`): a `<` that breaks either rule is a
    comparison."""
    if open_at == 0 or not (text[open_at - 1].isalnum() or text[open_at - 1] in "_:"):
        return None
    angle, j, n = 1, open_at + 1, len(text)
    while j < n:
        c = text[j]
        if c in "([":
            end = skip_group(text, j)
            if re.search(r"[{}.|]", text[j:end]):
                return None
            j = end
            continue
        if c in "{};.|)]":
            return None
        if c == "<" and not text.startswith("<=", j):
            angle += 1
        elif c == ">" and text[j - 1] not in "-=":
            angle -= 1
            if angle == 0:
                return j + 1
        j += 1
    return None


def skip_space(text, j):
    while j < len(text) and text[j].isspace():
        j += 1
    return j


def skip_attributes(text, j):
    """Past any outer attributes (`#[...]`) and the space around them."""
    while True:
        j = skip_space(text, j)
        m = re.compile(r"#\s*\[").match(text, j)
        if not m:
            return j
        j = skip_group(text, m.end() - 1)


# An item whose extent is its first `;` or its first `{...}` block, whatever the commas
# before (`fn f<A, B>(a: A, b: B) where A: X, B: Y {...}`): a declaration by its keyword, an
# `extern "ABI" {...}` block or a braced macro invocation (`thread_local! {...}`).
BRACED_ITEM = re.compile(
    r"(?:pub\s*(?:\([^()]*\))?\s*)?(?:(?:default|const|async|unsafe|safe|extern)\s+)*"
    r"(?:(?:fn|impl|mod|trait|struct|enum|union)\b|macro_rules\s*!|extern\s*\{)"
    r"|" + IDENT + r"(?:\s*::\s*" + IDENT + r")*\s*!\s*\{"
)
# An expression that ends with a block and needs no `;` or `,` after it: a block
# statement, a match arm's block body.
BLOCK_LIKE = re.compile(
    r"(?:(?:unsafe|async(?:\s+move)?|loop|const)\s*)?\{|(?:if|match|while|for)\b"
)


def skip_block_like(text, j):
    """The end of the block-like expression at `j` (see BLOCK_LIKE), `if` chains with their
    `else` branches included."""
    while True:
        brace = j
        while brace < len(text) and text[brace] != "{":
            if text[brace] in ";)]}":
                return brace
            brace = skip_group(text, brace) if text[brace] in "([" else brace + 1
        j = skip_group(text, brace)
        after = skip_space(text, j)
        if not re.compile(r"else\b").match(text, after):
            return j
        j = skip_space(text, after + len("else"))


def item_end(text, start):
    """The end of the item, statement, match arm, enum variant or field starting at `start`
    (its attributes already skipped). The extent is the exact one where Rust's syntax fixes
    it, and the shorter one where a guess is needed: code kept by mistake can only add an
    edge, code skipped by mistake could hide one."""
    n = len(text)
    if BRACED_ITEM.match(text, start):
        j = start
        while j < n:
            c = text[j]
            if c == "{":
                return skip_group(text, j)
            if c in "([":
                j = skip_group(text, j)
                continue
            if c in ")]}":
                return j
            if c == ";":
                return j + 1
            j += 1
        return n
    if BLOCK_LIKE.match(text, start):
        return skip_block_like(text, start)
    # A statement, match arm, enum variant or field: to the first `;` or `,` outside
    # brackets, or to the closer of the list it is part of.
    j, arm = start, False
    while j < n:
        c = text[j]
        if c in ")]}":
            return j
        if c in ";,":
            return j + 1
        if c in "([":
            j = skip_group(text, j)
            continue
        if c == "<":
            end = skip_generics(text, j)
            j = end if end is not None else j + 1
            continue
        if not arm and text.startswith("=>", j):
            arm = True
            body = skip_space(text, j + 2)
            if BLOCK_LIKE.match(text, body):
                # `pat => {...}` (or `=> if ... {...} else {...}`) ends with its block;
                # the comma after it is optional.
                end = skip_block_like(text, body)
                after = skip_space(text, end)
                return after + 1 if text.startswith(",", after) else end
            j = body
            continue
        if c == "{":
            j = skip_group(text, j)
            # After a block inside the item (a struct literal or pattern, an `if` in a
            # `let`), what follows says whether the item goes on: a `,` or `;`, an operator
            # that cannot start an expression, a method call, `else` or `as`. Anything else
            # starts the next item.
            after = skip_space(text, j)
            if after < n and text[after] in ",;=.?+/%^<>":
                continue
            if re.compile(r"(?:else|as)\b").match(text, after):
                continue
            return j
        j += 1
    return n


def is_test_only(predicate):
    """True for a cfg predicate that holds only when compiling tests: `test`, or `all(...)`
    with such a predicate among its terms. Any other predicate naming `test` (`any(test,
    feature = "x")`, `not(test)`) may hold in a normal build: its code is kept."""
    predicate = re.sub(r"\s+", "", predicate)
    if predicate == "test":
        return True
    m = re.fullmatch(r"all\((.*)\)", predicate)
    return bool(m) and any(is_test_only(term) for term in split_top_level(m.group(1)))


def split_top_level(text, sep=","):
    parts, depth, start = [], 0, 0
    for j, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:j])
            start = j + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


CFG_ATTR = re.compile(r"#\s*\[\s*cfg\s*\(")
INNER_CFG = re.compile(r"#!\s*\[\s*cfg\s*\((.*?)\)\s*\]", re.S)


def remove_test_items(text):
    """Blanks every item carrying a test-only `#[cfg(...)]`; returns the text and the names
    of test-only `mod x;` declarations (whose files belong to the tests)."""
    test_mods = set()
    at = 0
    while True:
        m = CFG_ATTR.search(text, at)
        if not m:
            return text, test_mods
        # The attribute's predicate runs to its balanced `)`, the attribute to its `]`.
        close = skip_group(text, m.end() - 1)
        at = close
        if not is_test_only(text[m.end():close - 1]):
            continue
        bracket = skip_space(text, close)
        start = skip_attributes(text, bracket + 1 if text.startswith("]", bracket) else close)
        end = item_end(text, start)
        item = text[m.start():end]
        decl = re.search(r"\bmod\s+(" + IDENT + r")\s*;", item)
        if decl:
            test_mods.add(decl.group(1))
        text = text[:m.start()] + "".join("\n" if c == "\n" else " " for c in item) + text[end:]
        at = end


def module_path_of(rel):
    """`san/io.rs` -> ('san', 'io'); `san/mod.rs` -> ('san',); `lib.rs` -> ()."""
    parts = rel[:-3].split("/")
    if parts[-1] == "mod":
        parts = parts[:-1]
    if parts in (["lib"], ["main"]):
        parts = []
    return tuple(parts)


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # rel path -> stripped text (test-only items blanked)
        self.file_module = {}  # rel path -> module path
        self.modules = {}  # module path -> rel path of the file holding it
        self.inline = {}  # rel path -> [(start, end, module path)] of inline modules
        self.test_files = set()
        self.load()

    def load(self):
        texts, test_decls = {}, {}
        for root, dirs, names in os.walk(self.src):
            dirs.sort()
            rel_root = os.path.relpath(root, self.src)
            # src/bin/* are crates of their own.
            if rel_root.split(os.sep)[0] == "bin":
                continue
            for name in sorted(names):
                if not name.endswith(".rs"):
                    continue
                rel = os.path.normpath(os.path.join(rel_root, name)).replace(os.sep, "/")
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    text = strip_comments_and_literals(f.read())
                texts[rel], test_decls[rel] = remove_test_items(text)
                # `#![cfg(test)]`: the whole file is test code.
                for m in INNER_CFG.finditer(text):
                    if is_test_only(m.group(1)):
                        self.test_files.add(rel)
        for rel in texts:
            self.file_module[rel] = module_path_of(rel)
        # Files declared by test-only `mod x;` (and everything below them) are test code.
        for rel, names in test_decls.items():
            for name in names:
                base = self.file_module[rel] + (name,)
                for other, module in self.file_module.items():
                    if module[:len(base)] == base:
                        self.test_files.add(other)
        for rel, text in texts.items():
            if rel in self.test_files:
                continue
            self.files[rel] = text
            self.modules[self.file_module[rel]] = rel
        for rel, text in self.files.items():
            spans = []
            for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", text):
                spans.append([m.end() - 1, matching_brace(text, m.end() - 1), m.group(1)])
            resolved = []
            for start, end, name in spans:
                outer = [s for s in spans if s[0] < start and end <= s[1]]
                outer.sort(key=lambda s: s[0])
                path = self.file_module[rel] + tuple(s[2] for s in outer) + (name,)
                resolved.append((start, end, path))
                self.modules.setdefault(path, rel)
            self.inline[rel] = resolved

    def module_at(self, rel, offset):
        """The module path in force at `offset` of file `rel` (inline modules included)."""
        best = self.file_module[rel]
        for start, end, path in self.inline[rel]:
            if start <= offset < end and len(path) > len(best):
                best = path
        return best

    def resolve(self, module, segments, aliases):
        """Walks a path used inside `module` down the module tree: returns the deepest module
        reached and the segments left (an item's name first), or None when the path does not
        start in this crate."""
        first = segments[0]
        if first in ("crate", "$crate"):
            at, rest = (), segments[1:]
        elif first == "self":
            at, rest = module, segments[1:]
        elif first == "super":
            at, rest = module, segments
            while rest and rest[0] == "super":
                if not at:
                    return None
                at, rest = at[:-1], rest[1:]
        elif module + (first,) in self.modules:
            at, rest = module + (first,), segments[1:]
        elif first in aliases:
            at, rest = aliases[first], segments[1:]
        else:
            return None
        while rest:
            if rest[0] == "self":
                rest = rest[1:]
            elif at + (rest[0],) in self.modules:
                at, rest = at + (rest[0],), rest[1:]
            else:
                break
        if at not in self.modules:
            return None
        return at, rest

    def target(self, at, rest, depth=0):
        """The file and name a resolved path ties to. A name that its file only re-exports
        (`pub use x::Name` at file level) leads on to where it comes from, and to no file
        of this crate when it comes from another crate: the re-exporting file holds no code
        of it."""
        rel = self.modules[at]
        if rest and depth < 16 and at == self.file_module[rel]:
            bound = self.reexports[rel].get(rest[0])
            if bound is not None:
                hit = self.resolve(at, bound + rest[1:], self.aliases[rel])
                return self.target(*hit, depth + 1) if hit else None
        if rest:
            return rel, rest[0]
        # The module itself (`use crate::runtime;`): the names used through it, if any, say
        # more (see `shown_names`).
        return rel, "mod " + (at[-1] if at else "crate")


def expand_use_tree(tree):
    """`crate::{a, b::{c, self}}` -> [(['crate','a'], 'a'), (['crate','b','c'], 'c'),
    (['crate','b','self'], 'b')]: each path with the name it binds (renames are applied by
    `parse_use`)."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, t):
        if not t:
            return
        if t.endswith("}"):
            brace = t.index("{")
            head = t[:brace].rstrip(":")
            base = prefix + [s for s in head.split("::") if s]
            for part in split_top_level(t[brace + 1:-1]):
                walk(base, part)
            return
        segments = prefix + [s for s in t.split("::") if s]
        bound = None
        if segments[-1] == "self":
            bound = segments[-2] if len(segments) > 1 else None
        elif segments[-1] != "*":
            bound = segments[-1]
        out.append((segments, bound))

    walk([], tree)
    return out


USE_DECL = re.compile(r"\buse\s+((?:::)?[^;]*?);", re.S)
RENAME = re.compile(r"\b(" + IDENT + r"|self|\*)\s+as\s+(" + IDENT + r")\b")
PATH = re.compile(
    r"(?<![\w:$])(\$?" + IDENT + r")((?:\s*::\s*(?:" + IDENT + r"|\*))+)"
)


def parse_use(decl):
    """Expands one use tree into (segments, bound name) pairs, renames applied."""
    renames = {}

    def mark(m):
        key = "__rename%d" % len(renames)
        renames[key] = (m.group(1), m.group(2))
        return key

    decl = RENAME.sub(mark, decl)
    result = []
    for segments, bound in expand_use_tree(decl):
        if segments[-1] in renames:
            original, new = renames[segments[-1]]
            segments = segments[:-1] + [original]
            bound = new if new != "_" else None
        result.append((segments, bound))
    return result


def brace_depths(text, offsets):
    """The `{` nesting depth at each of the (sorted) offsets."""
    depths, depth, at = [], 0, 0
    for offset in offsets:
        chunk = text[at:offset]
        depth += chunk.count("{") - chunk.count("}")
        at = offset
        depths.append(depth)
    return depths


def analyse(src):
    """Returns (crate, edges) where edges maps (from file, to file) -> set of names."""
    crate = Crate(src)
    edges = {}
    uses_of, use_spans_of = {}, {}
    crate.aliases, crate.reexports = {}, {}
    for rel, text in crate.files.items():
        decls = list(USE_DECL.finditer(text))
        depths = brace_depths(text, [m.start() for m in decls])
        uses = []  # (offset, segments, bound name)
        reexports = {}
        for m, depth in zip(decls, depths):
            for segments, bound in parse_use(m.group(1)):
                uses.append((m.start(), segments, bound))
                if depth == 0 and bound:
                    reexports[bound] = segments
        uses_of[rel] = uses
        use_spans_of[rel] = [(m.start(), m.end()) for m in decls]
        crate.reexports[rel] = reexports
        # Aliases of modules: `use super::io;` lets `io::settle` name san/io.rs. Two rounds
        # let a use tree start from an alias bound by another one.
        aliases = {}
        for _ in range(2):
            for offset, segments, bound in uses:
                hit = crate.resolve(crate.module_at(rel, offset), segments, aliases)
                if hit and not hit[1] and bound:
                    aliases[bound] = hit[0]
        crate.aliases[rel] = aliases

    def add(rel, module, segments):
        hit = crate.resolve(module, segments, crate.aliases[rel])
        hit = hit and crate.target(*hit)
        if hit and hit[0] != rel:
            edges.setdefault((rel, hit[0]), set()).add(hit[1])

    for rel, text in crate.files.items():
        for offset, segments, _ in uses_of[rel]:
            add(rel, crate.module_at(rel, offset), segments)
        spans = use_spans_of[rel]
        for m in PATH.finditer(text):
            if any(start <= m.start() < end for start, end in spans):
                continue
            segments = [m.group(1)] + [
                s.strip() for s in m.group(2).split("::") if s.strip()
            ]
            add(rel, crate.module_at(rel, m.start()), segments)
    return crate, edges


def strongly_connected(nodes, edges):
    """Tarjan's algorithm, iterative; returns the components (lists of nodes)."""
    succ = {n: sorted({b for (a, b) in edges if a == n}) for n in nodes}
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    comps.append(sorted(comp))
    return comps


def circles(src):
    crate, edges = analyse(src)
    comps = [c for c in strongly_connected(crate.files, edges) if len(c) > 1]
    return crate, edges, sorted(comps)


def shown_names(names):
    """The names tying an edge; a module imported whole only when nothing more precise is
    known of the edge."""
    items = sorted(n for n in names if not n.startswith("mod "))
    return ", ".join(items or sorted(names))


def check(src, out=sys.stdout):
    """Prints the verdict for one crate; returns True when it has no circle."""
    crate, edges, comps = circles(src)
    label = src.rstrip("/")
    if not comps:
        print(
            "check-layering: %s: OK, %d files, %d file-to-file edges, no circle"
            % (label, len(crate.files), len(edges)),
            file=out,
        )
        return True
    print(
        "check-layering: %s: %d circle(s) in the module graph" % (label, len(comps)),
        file=out,
    )
    for comp in comps:
        members = set(comp)
        print("  circle of %d files: %s" % (len(comp), ", ".join(comp)), file=out)
        for (a, b), names in sorted(edges.items()):
            if a in members and b in members:
                print("    %s -> %s: %s" % (a, b, shown_names(names)), file=out)
    return False


SELF_TESTS = {
    # name: (files, expected circles as sorted lists of files[, expected edges as
    # (from, to, present)])
    "cycle through use": (
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::helper;\npub fn top() { helper() }\n",
            "b.rs": "use crate::{a::top as t};\npub fn helper() {}\npub fn x() { t() }\n",
        },
        [["a.rs", "b.rs"]],
    ),
    "cycle through an inline super:: path": (
        {
            "lib.rs": "mod net;\npub fn root() {}\n",
            "net/mod.rs": "mod io;\npub use io::send;\npub fn lock() {}\n",
            "net/io.rs": "pub fn send() {\n    super::lock();\n    super::super::root();\n}\n",
        },
        [["net/io.rs", "net/mod.rs"]],
    ),
    "acyclic": (
        {
            "lib.rs": "mod low;\nmod high;\npub use high::run;\n",
            "low.rs": "// crate::high::run() in a comment is no edge\n"
            "pub const NAME: &str = \"crate::high::run\";\npub fn base() {}\n",
            "high.rs": "use crate::low::{self, base};\n"
            "pub fn run() { base(); let _ = low::NAME; let _ = '\"'; }\n",
        },
        [],
    ),
    "cycle only inside #[cfg(test)]": (
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "pub fn f() { crate::b::g() }\n",
            "b.rs": "pub fn g() {}\n\n#[cfg(test)]\nmod tests {\n    use crate::a::f;\n"
            "    #[test]\n    fn t() { f(); crate::a::f(); }\n}\n",
        },
        [],
    ),
    # A facade: the root re-exports its children's names and they import each other's
    # through it; a name only re-exported ties to where it is defined (or to no file when
    # another crate defines it).
    "re-exports lead to the defining file": (
        {
            "lib.rs": "mod error;\nmod conn;\npub use conn::Conn;\npub use error::Error;\n"
            "pub use std::io::Result;\n",
            "error.rs": "pub struct Error;\n",
            "conn.rs": "use crate::{Error, Result};\npub struct Conn(Error);\n"
            "pub fn open() -> Result<()> { Ok(()) }\n",
        },
        [],
    ),
    # `#[cfg(test)]` on a match arm, an enum variant or a field skips that one element: the
    # non-test ones after it still count.
    "a test-only match arm hides no arm after it": (
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "pub enum E { X, Y }\npub fn f(e: E) -> bool {\n    match e {\n"
            "        #[cfg(test)]\n        E::X => true,\n"
            "        E::Y => crate::b::g(),\n    }\n}\n"
            "pub fn h() -> u8 {\n    7\n}\n",
            "b.rs": "pub fn g() -> bool { crate::a::h() > 0 }\n",
        },
        [["a.rs", "b.rs"]],
    ),
    "a test-only enum variant hides no variant after it": (
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "pub enum Link {\n    Shm(u8),\n    #[cfg(test)]\n    Sim(u16),\n"
            "    Verbs(crate::b::VerbsLink),\n}\n"
            "impl From<u8> for Link {\n    fn from(v: u8) -> Link { Link::Shm(v) }\n}\n",
            "b.rs": "pub struct VerbsLink;\npub fn wrap() -> crate::a::Link { 0u8.into() }\n",
        },
        [["a.rs", "b.rs"]],
    ),
    "a test-only arm naming test code is no edge": (
        {
            "lib.rs": "mod link;\npub mod testing;\n#[cfg(test)]\nmod in_process_tests;\n",
            "link.rs": "pub enum Link {\n    Shm(u8),\n"
            "    #[cfg(test)]\n    Sim(crate::in_process_tests::SimLink),\n}\n"
            "impl Link {\n    pub fn is_up(&self) -> bool {\n        match self {\n"
            "            Link::Shm(_) => true,\n            #[cfg(test)]\n"
            "            Link::Sim(link) => crate::testing::up(link),\n        }\n    }\n}\n",
            "testing.rs": "pub fn up(_: &crate::link::Link) -> bool { true }\n",
            "in_process_tests.rs": "pub struct SimLink;\n"
            "pub fn f(l: &crate::link::Link) -> bool { l.is_up() }\n",
        },
        [],
        [("link.rs", "testing.rs", False), ("testing.rs", "link.rs", True)],
    ),
    # Further attributes after `#[cfg(test)]`, an arm whose block needs no comma, a test-only
    # field whose type holds a comma, and predicates that may hold outside tests.
    "test-only code skipped exactly, other cfg code kept": (
        {
            "lib.rs": "mod a;\nmod b;\nmod c;\nmod d;\nmod e;\n",
            "a.rs": "pub enum E { X, Y }\npub fn f(e: E) -> u8 {\n    match e {\n"
            "        #[cfg(test)]\n        #[allow(unreachable_patterns)]\n"
            "        E::X => if true {\n            0\n        } else {\n"
            "            crate::b::t()\n        }\n        E::Y => crate::c::g(),\n    }\n}\n"
            "pub struct S {\n    #[cfg(test)]\n    m: HashMap<u8, crate::b::T>,\n"
            "    n: Vec<crate::e::U>,\n}\n"
            "#[cfg(all(test, unix))]\nfn in_test() { crate::b::t(); }\n"
            "#[cfg(any(test, feature = \"sim\"))]\npub fn sim() { crate::d::run(); }\n",
            "b.rs": "pub struct T;\npub fn t() -> u8 { crate::a::f(crate::a::E::Y) }\n",
            "c.rs": "pub fn g() -> u8 { let _ = crate::a::E::X; 1 }\n",
            "d.rs": "pub fn run() { crate::a::sim() }\n",
            "e.rs": "pub struct U;\npub fn new() -> crate::a::S { todo!() }\n",
        },
        [["a.rs", "c.rs", "d.rs", "e.rs"]],
    ),
}


def self_test():
    failures = 0
    for name, (files, expected, *expected_edges) in SELF_TESTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            for rel, text in files.items():
                path = os.path.join(tmp, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            _, edges, comps = circles(tmp)
        wrong_edges = [
            (a, b, present)
            for a, b, present in (expected_edges[0] if expected_edges else [])
            if ((a, b) in edges) != present
        ]
        if comps == expected and not wrong_edges:
            print("check-layering self-test: %s: ok" % name)
        else:
            failures += 1
            print(
                "check-layering self-test: %s: FAILED, expected %s, found %s (edges %s%s)"
                % (
                    name,
                    expected,
                    comps,
                    sorted(edges),
                    "; expected (from, to, present): %s" % wrong_edges if wrong_edges else "",
                ),
                file=sys.stderr,
            )
    return failures == 0


def print_edges(src, out=sys.stdout):
    """Prints every file-to-file edge of one crate with all the names behind it (to compare
    the graph before and after a change to this script or to the crate)."""
    _, edges = analyse(src)
    print("# %s" % src.rstrip("/"), file=out)
    for (a, b), names in sorted(edges.items()):
        print("%s -> %s: %s" % (a, b, ", ".join(sorted(names))), file=out)


def main(argv):
    if argv == ["--self-test"]:
        return 0 if self_test() else 1
    edges_only = bool(argv) and argv[0] == "--edges"
    if edges_only:
        argv = argv[1:]
    if not argv or any(a.startswith("-") for a in argv):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    ok = True
    for src in argv:
        if not os.path.isdir(src):
            print("check-layering: %s is not a directory" % src, file=sys.stderr)
            return 2
        if edges_only:
            print_edges(src)
        else:
            ok = check(src) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
