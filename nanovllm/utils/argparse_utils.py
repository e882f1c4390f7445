"""vLLM's FlexibleArgumentParser (vllm.utils.argparse_utils), so that the command lines of vLLM's offline examples
parse with `vllm` -> `nanovllm` as their only change: an argparse.ArgumentParser that also reads `--flag_name` as
`--flag-name`, and `--json-flag.key value` (or `--json-flag.key=value`) as `--json-flag '{"key": value}'`, the keys
of one flag merged into one dict, as vLLM's does. The flags themselves are the script's and EngineArgs.add_cli_args'."""
import argparse
import json
import re
import sys

_DOTTED = re.compile(r"(--?[A-Za-z][\w-]*)\.(.+)")  # a flag and its dotted keys (not a value such as -0.5)


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self._vllm_args(sys.argv[1:] if args is None else list(args)), namespace)

    def _vllm_args(self, args: list[str]) -> list[str]:
        """The command line as vLLM's parser rewrites it: underscores in a long flag's name become dashes; dotted
        keys become one JSON dict per flag, given after the other flags (a key's value is JSON where it parses, else
        text)."""
        out, dicts, positional = [], {}, []
        rest = iter(args)
        for arg in rest:
            if arg == "--":  # (the rest are positional)
                positional = [arg, *rest]
                break
            key, eq, value = arg.partition("=")
            if key.startswith("--"):
                name, dot, keys = key[2:].partition(".")
                key = "--" + name.replace("_", "-") + dot + keys
            dotted = _DOTTED.fullmatch(key)
            if dotted is None:
                out.append(key + eq + value)
                continue
            if not eq:
                value = next(rest, None)
                if value is None:
                    self.error(f"{key} needs a value")
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
            node, *path = dicts.setdefault(dotted.group(1), {}), *dotted.group(2).split(".")
            for name in path[:-1]:
                node = node.setdefault(name, {})
            node[path[-1]] = value
        for flag, value in dicts.items():
            out += [flag, json.dumps(value)]
        return out + positional
