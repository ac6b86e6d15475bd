"""``kvroute rollout``: start a rolling upgrade on a running router and follow it to the end.

A client of the router's admin API (``POST /admin/rollout``, ``GET /admin/rollout``); the
router does the work (router/rollout.py), so the rollout goes on if this command is stopped.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

import httpx

from kvroute.router.config import Config, load_config, resolve_secret

POLL_S = 1.0


def add_rollout_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "rollout",
        help="Rolling upgrade of a running router's launched replicas, one at a time.",
        description=(
            "Replace every replica the router launched (launch: in its config, or one pool's "
            "launch: with --pool), one at a time: drain it (no new requests; open streams get --drain-timeout seconds, then "
            "continue on another replica), stop it, start it with the new arguments, wait until "
            "it answers its health check (and passes the drift canary when canary: is on), "
            "return it to rotation, next. Prints progress until the rollout ends; exits 0 when "
            "every replica was replaced, 1 when it failed or was aborted. With --pause, "
            "--resume, --abort or --status, acts on the rollout in progress instead."
        ),
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="The router's config: its listen address and auth.admin_api_key.",
    )
    p.add_argument("--url", help="The router's URL (default: from the config's listen:).")
    p.add_argument(
        "--admin-key", metavar="KEY", help="Admin key (default: the config's auth.admin_api_key)."
    )
    p.add_argument(
        "--pool",
        metavar="NAME",
        help="The model pool whose launched replicas to replace (needed when several pools "
        "launch replicas; pools[N].name in the config).",
    )
    p.add_argument(
        "--args",
        metavar="'ARGS'",
        help="The replicas' new extra arguments (launch.extra_args), as one shell-quoted "
        "string: --args='--max-num-seqs 128 --enforce-eager'. Default: unchanged.",
    )
    p.add_argument(
        "--model-path",
        metavar="DIR",
        help="vLLM replicas: the new model directory. Default: unchanged.",
    )
    p.add_argument(
        "--max-unavailable",
        type=int,
        metavar="N",
        help="Replicas replaced at once (default: the config's rollout.max_unavailable).",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="Seconds a replica's requests get to finish before open streams are moved.",
    )
    p.add_argument(
        "--readiness-timeout",
        type=float,
        metavar="S",
        help="Seconds a new replica gets to become ready.",
    )
    action = p.add_mutually_exclusive_group()
    for flag in ("pause", "resume", "abort"):
        action.add_argument(
            f"--{flag}",
            action="store_const",
            const=flag,
            dest="action",
            help=f"{flag.title()} the rollout in progress.",
        )
    action.add_argument(
        "--status", action="store_const", const="status", dest="action",
        help="Print the rollout's progress once.",
    )  # fmt: skip
    p.add_argument(
        "--no-wait", action="store_true", help="Start the rollout and exit without following it."
    )
    p.set_defaults(func=_cmd_rollout)


def router_url(config: Config | None, url: str | None) -> str:
    if url:
        return url.rstrip("/")
    if config is None:
        return "http://127.0.0.1:8000"
    host = config.listen.host
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: reach it here
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.listen.port}"


def _headers(config: Config | None, key: str | None) -> dict[str, str]:
    if key is None and config is not None and config.auth.admin_api_key:
        key = resolve_secret(config.auth.admin_api_key, "auth.admin_api_key")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _cmd_rollout(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config else None
    url = router_url(config, args.url)
    with httpx.Client(base_url=url, headers=_headers(config, args.admin_key), timeout=30.0) as http:
        try:
            return _run(http, args)
        except httpx.HTTPError as exc:
            print(f"kvroute rollout: cannot reach the router at {url}: {exc}", file=sys.stderr)
            return 2
        except _Refused as exc:
            print(f"kvroute rollout: {exc}", file=sys.stderr)
            return 2


class _Refused(Exception):
    pass


def _call(http: httpx.Client, method: str, path: str, body: Any = None) -> dict[str, Any]:
    resp = http.request(method, path, json=body)
    try:
        data: dict[str, Any] = resp.json()
    except ValueError:
        data = {}
    if resp.status_code >= 400:
        message = (data.get("error") or {}).get("message") or resp.text[:200]
        raise _Refused(f"the router refused ({resp.status_code}): {message}")
    return data


def _run(http: httpx.Client, args: argparse.Namespace) -> int:
    if args.action == "status":
        print(_describe(_call(http, "GET", "/admin/rollout")["rollout"]))
        return 0
    if args.action is not None:
        print(_describe(_call(http, "POST", f"/admin/rollout/{args.action}")["rollout"]))
        return 0
    body: dict[str, Any] = {}
    if args.args is not None:
        body["args"] = shlex.split(args.args)
    for key, value in (
        ("pool", args.pool),
        ("model_path", args.model_path),
        ("max_unavailable", args.max_unavailable),
        ("drain_timeout_s", args.drain_timeout),
        ("readiness_timeout_s", args.readiness_timeout),
    ):
        if value is not None:
            body[key] = value
    progress = _call(http, "POST", "/admin/rollout", body)["rollout"]
    print(f"kvroute rollout: replacing {', '.join(progress['targets'])}", flush=True)
    if args.no_wait:
        return 0
    return follow(http)


def follow(http: httpx.Client) -> int:
    """Print each replaced replica as it comes; the exit status of the rollout's end."""
    shown = 0
    while True:
        progress = _call(http, "GET", "/admin/rollout")["rollout"]
        for step in progress["replaced"][shown:]:
            print(
                f"  {step['name']}: replaced in {step['seconds']:.1f}s (drain {step['drain_s']:.1f}s"
                f", start {step['start_s']:.1f}s; {step['moved']} moved, {step['lost']} lost)",
                flush=True,
            )
        shown = len(progress["replaced"])
        if progress["state"] not in ("running", "paused"):
            print(_describe(progress), flush=True)
            return 0 if progress["state"] == "done" else 1
        time.sleep(POLL_S)


def _describe(progress: dict[str, Any] | None) -> str:
    if progress is None:
        return "no rollout has run on this router"
    line = (
        f"rollout {progress['state']}: {len(progress['replaced'])} of "
        f"{len(progress['targets'])} replaced"
    )
    if progress["current"]:
        line += f", replacing {', '.join(progress['current'])}"
    if progress.get("error"):
        line += f"; error: {progress['error']}"
    return line
