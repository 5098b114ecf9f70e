"""`prfaas up --config FILE [--machine NAME]`: start this machine's share of a deployment."""
from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Start the servers (and the router, if placed here) of a deployment file on this machine, wait until each
answers /health, then keep them running until stopped.

Stopping: SIGTERM, SIGINT (Ctrl-C) and SIGHUP stop every server and the router it started: SIGTERM to each
process group (SGLang's scheduler and detokenizer included), SIGKILL to what is left after --stop-grace-s;
then it exits 0. A signal that was ignored when it started (nohup, a background job) stays ignored. If it
crashes it stops them the same way; if it is killed outright (SIGKILL, the OOM killer) each server and the
router get SIGKILL from the kernel (parent-death signal), also those started through `ip netns exec`.

Restarts: a server or the router that dies is restarted with the same flags on the same ports after a delay
of 1 s, doubling with each death that comes before it was healthy for 60 s (at most --restart-max-delay-s);
60 s of health resets the count. After --restart-give-up-after such deaths in a row it stays down and a
GIVING UP message goes to stdout and stderr; the rest keeps serving. Each restart is logged (its output is
appended to the same log file) and listed by the supervisor's GET /restarts. The router probes /health and
takes a restarted server back by itself.

Supervisor ([supervisor] section): POST /servers/NAME/start of a server that runs is refused with 409 (stop
it first): a second server would orphan the first. With PRFAAS_SUPERVISOR_TOKEN (at least 32 bytes; one value
for every machine, or per machine as http://HOST:PORT=TOKEN pairs, the router holding all of them) every
request is signed with HMAC-SHA256, timestamp (30 s window: keep clocks on NTP) and nonce; the token is never
sent. Without a token the supervisor listens on loopback only. Browser requests are refused (JSON bodies
only, foreign Origin refused).

Exit status: 0 after a stop signal, 1 when a process failed to come up or it failed itself, 2 when the
deployment or the token was refused before anything started."""


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="start the servers and router of a deployment file placed on this machine",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="deployment TOML (see docs/deploy-two-datacenters.toml)")
    p.add_argument("--machine", default=None, help="start only what is placed on this machine (default: all)")
    p.add_argument("--log-dir", default="out/up", help="server and router logs")
    p.add_argument("--stop-grace-s", type=float, default=15.0,
                   help="seconds between SIGTERM and SIGKILL when stopping (default 15)")
    p.add_argument("--restart-max-delay-s", type=float, default=60.0,
                   help="longest wait before restarting a process that died (default 60)")
    p.add_argument("--restart-give-up-after", type=int, default=5,
                   help="deaths in a row, each before 60 s of health, after which a process stays down (default 5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prfaas_sgl.tools.deploy import config, up
    from prfaas_sgl.tools.deploy.keeper import RestartPolicy

    try:
        policy = RestartPolicy(max_delay_s=args.restart_max_delay_s, give_up_after=args.restart_give_up_after)
    except ValueError as e:
        print(f"prfaas up: {e}")
        return 2
    try:
        dep = config.load(args.config)
    except (ValueError, TypeError, OSError) as e:
        print(f"prfaas up: {args.config}: {e}")
        return 2
    return up.run(dep, args.machine, Path(args.log_dir), policy=policy, grace_s=args.stop_grace_s)
