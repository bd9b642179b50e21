"""`dpctl queue` and `dpctl priority`: sharing the pool (README: "Sharing the pool").

    dpctl queue [--json]          the live jobs in queue order (priority, then submission): what each
                                  holds and should hold, what it waits for, what it would take from whom
    dpctl priority JOB N [--json] a queued or running job's new priority (higher runs first)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import orjson

from dpool.client.errors import BadInput
from dpool.client.rpc import Client
from dpool.client.tables import age, table
from dpool.protocol.jobspec import check_priority
from dpool.protocol.sharing import PriorityReply, Queue, QueueReply, QueueRow, SetPriority


def add_parser(sub: Any) -> None:
    s = sub.add_parser("queue", help="the live jobs in queue order: priority, workers now and due, what each waits for and would take from whom")
    s.add_argument("--json", action="store_true", help="a JSON array of {position, id, name, priority, state, workers, target, min, max, submitted, waiting, takes}")
    s.set_defaults(fn=cmd_queue)
    s = sub.add_parser("priority", help="set a queued or running job's priority (higher runs first, taking slots from lower ones)")
    s.add_argument("job", help="a job id, unique id prefix or name")
    s.add_argument("priority", type=int, help="an integer; higher runs first (the default is 0)")
    s.add_argument("--json", action="store_true", help='print {"id", "priority", "previous", "state"}')
    s.set_defaults(fn=cmd_priority)


def takes_text(r: QueueRow) -> str | None:
    return ", ".join(f"{t.slots} from {t.job} ({'preempting it' if t.how == 'preempt' else 'shrinking it'})" for t in r.takes) or None


def cmd_queue(c: Client, a: argparse.Namespace) -> int:
    rows = c.call(Queue(), QueueReply).rows
    if getattr(a, "json", False):
        sys.stdout.write(orjson.dumps([r.to_wire() for r in rows], option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    if not rows:
        print("the queue is empty: no job is queued or running")
        return 0
    now = time.time()
    print(table(
        ["#", "JOB", "PRIORITY", "STATE", "WORKERS", "DUE", "MIN-MAX", "AGE", "WAITS FOR", "TAKES"],
        [[r.position, r.id, r.priority, r.state, r.workers, r.target, f"{r.min}-{r.max}", age(now - r.submitted), r.waiting, takes_text(r)] for r in rows],
    ))
    return 0


def cmd_priority(c: Client, a: argparse.Namespace) -> int:
    if (err := check_priority(a.priority)) is not None:  # before the wire: a 2**64 cannot even be sent
        raise BadInput(f"priority {a.priority}: {err}")
    reply = c.call(SetPriority(job=a.job, priority=a.priority), PriorityReply)
    if getattr(a, "json", False):
        sys.stdout.write(orjson.dumps({"id": reply.job_id, "priority": reply.priority, "previous": reply.previous, "state": reply.state}).decode() + "\n")
    else:
        print(f"job {reply.job_id} ({reply.state}): priority {reply.previous} -> {reply.priority}; `dpctl queue` shows where it stands")
    return 0
