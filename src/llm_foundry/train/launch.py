"""How this process was launched, as run.json records it with each command that started or
resumed a run (``launch``), and the command line that launches a recorded command the same way:
``torchrun --nproc-per-node N -m llm_foundry train ...`` for a job of N processes per node, so
that running it again trains on the same processes, parallel mode and global batch."""

from __future__ import annotations

import os
import shlex


def launch_record() -> dict:
    """How this process was launched, for run.json: the number of processes, and under
    torchrun (it sets ``LOCAL_WORLD_SIZE``) the processes per node and the number of nodes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    record: dict = dict(world_size=world)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and world > 1:
        per_node = int(local)
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "0")) or max(1, world // per_node)
        record["torchrun"] = dict(nproc_per_node=per_node, nnodes=nodes)
    return record


def launcher_words(launch: dict | None) -> tuple[list[str], str]:
    """(the words that start a command launched as ``launch_record`` says, in place of
    ``llm-foundry``; a note on where to run it, or ""). A record without torchrun's numbers on
    several processes: the plain command and a note that it ran on that many."""
    launch = launch if isinstance(launch, dict) else {}
    world = launch.get("world_size")
    run = launch.get("torchrun")
    if not isinstance(world, int) or world <= 1:
        return ["llm-foundry"], ""
    if not isinstance(run, dict) or not all(
        isinstance(run.get(k), int) and run[k] >= 1 for k in ("nproc_per_node", "nnodes")
    ):
        return ["llm-foundry"], f" (it ran as {world} processes: launch it as it was launched)"
    words = ["torchrun"]
    note = ""
    if run["nnodes"] > 1:
        words += ["--nnodes", str(run["nnodes"])]
        note = f" (on each of its {run['nnodes']} nodes, with the rendezvous flags it had)"
    words += ["--nproc-per-node", str(run["nproc_per_node"]), "-m", "llm_foundry"]
    return words, note


def launched_command(argv: list[str], launch: dict | None) -> str:
    """``argv`` (a recorded ``sys.argv``: its first word the program) as the shell command line
    that runs it again the way ``launch`` (``launch_record``) says it was launched."""
    words, note = launcher_words(launch)
    return shlex.join([*words, *argv[1:]]) + note
