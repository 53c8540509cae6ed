#!/usr/bin/env python3
"""Counts, under the given paths (default src/device), the Rust files over 600 lines and
the functions whose bodies span more than 50 lines (issue 23's measures).

A function is `fn name` followed by its body; the body is found by brace matching, with
comments, string literals and char literals skipped (raw strings r"..", r#".."# too). A
function's length is the number of lines from its `fn` line to its closing brace. A
trait method without a body (`fn f();`) is not counted. Lines of nested functions count
for the outer one as well.

    tools/long_fns.py [--list] [--max-fn N] [--max-file N] [PATH...]
"""
import os
import re
import sys

FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def strip(src):
    """The source with comments and the contents of literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", src[i:]).group(1)
            end = src.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", src[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", src[i : j + 1]))
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{..}'), else a lifetime.
            m = re.match(r"'(\\[^']*|[^'\\])'", src[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(src):
    """(name, first line, lines) of every function with a body."""
    code = strip(src)
    found = []
    for m in FN.finditer(code):
        j, depth = m.end(), 0
        # The body opens at the first `{` outside parentheses/brackets/angles of the
        # signature; a `;` first means no body.
        paren = 0
        while j < len(code):
            ch = code[j]
            if ch in "([":
                paren += 1
            elif ch in ")]":
                paren -= 1
            elif ch == ";" and paren == 0:
                j = -1
                break
            elif ch == "{" and paren == 0:
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        while j < len(code):
            if code[j] == "{":
                depth += 1
            elif code[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, j) + 1
        found.append((m.group(1), first, last - first + 1))
    return found


def rust_files(paths):
    for p in paths:
        if os.path.isfile(p):
            yield p
        for root, _, files in os.walk(p):
            for f in sorted(files):
                if f.endswith(".rs"):
                    yield os.path.join(root, f)


def main(argv):
    args = argv[1:]
    listing = "--list" in args
    args = [a for a in args if a != "--list"]
    max_fn, max_file = 50, 600
    for flag in ("--max-fn", "--max-file"):
        if flag in args:
            k = args.index(flag)
            val = int(args[k + 1])
            del args[k : k + 2]
            if flag == "--max-fn":
                max_fn = val
            else:
                max_file = val
    paths = args or ["src/device"]
    long_files, long_fns = [], []
    for f in sorted(set(rust_files(paths))):
        src = open(f, encoding="utf-8").read()
        lines = src.count("\n")
        if lines > max_file:
            long_files.append((f, lines))
        for name, first, n in functions(src):
            if n > max_fn:
                long_fns.append((f, first, name, n))
    if listing:
        for f, n in long_files:
            print(f"file {f}: {n} lines")
        for f, first, name, n in long_fns:
            print(f"fn   {f}:{first} {name}: {n} lines")
    print(f"files over {max_file} lines: {len(long_files)}")
    print(f"functions over {max_fn} lines: {len(long_fns)}")


if __name__ == "__main__":
    main(sys.argv)
