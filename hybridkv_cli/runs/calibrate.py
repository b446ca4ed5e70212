"""``hybridkv calibrate``: a model's label file, from the prompts of dev tasks.

Each task's prompt (media or text context, and its question) runs once through the model with
the whole cache kept; every layer adds up its channels' weights
(:class:`~hybridkv_cli.compression.labels.ChannelCalibration`). The mean is the label file that
``--landmark labels --index-file FILE`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv_cli.compression.labels import ChannelCalibration
from hybridkv_cli.io.atomic import write_atomically
from hybridkv_cli.runs.bench import Task
from hybridkv_cli.runs.requests import Request


def calibrate(session, tasks: list[Task], output: Path, on_run=None) -> dict:
    """Write the label file of ``session``'s model from ``tasks`` to ``output``; returns its content
    (``on_run(label)`` is called before each prompt: progress)."""
    policy = ChannelCalibration()
    for task in tasks:
        if on_run:
            on_run(task.id)
        session.ask(Request(prepared=session.prepare_task(task), policy=policy, max_new_tokens=1))
    content = policy.file(session.options.model)
    write_atomically(output, lambda tmp: Path(tmp).write_text(json.dumps(content) + "\n"))
    return content
