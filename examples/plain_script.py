"""Submit a training job to gpuq, wait for it, and exit with its outcome: the producer SDK from a plain script.

    export GPUQ_API_URL=http://gpuq-api:8000 GPUQ_TOKEN=gpuq_...   # a team's token: it decides the team
    python examples/plain_script.py --gpus 8 --max-runtime 7200 --label project=llm

The job goes to the team's default queue unless --queue names one. Exit status: 0 when the job completed, 1 when
it failed, was cancelled or was refused, 2 when it did not end within --timeout.
"""

from __future__ import annotations

import argparse
import sys

from gpuq_sdk import Client, SubmissionRefused, WaitTimeout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per pod")
    parser.add_argument("--pods", type=int, default=1, help="pods in the gang")
    parser.add_argument("--queue", help="queue (default: the team's default queue)")
    parser.add_argument("--max-runtime", type=int, default=3600, help="the job's runtime limit in seconds")
    parser.add_argument("--label", action="append", default=[], help="key=value cost-attribution label")
    parser.add_argument("--timeout", type=float, default=24 * 3600, help="how long to wait for the job, seconds")
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between status reads")
    args = parser.parse_args(argv)
    labels = dict(item.split("=", 1) for item in args.label)

    with Client() as gpuq:
        try:
            job = gpuq.submit(gpus=args.gpus, pods=args.pods, queue=args.queue, max_runtime_s=args.max_runtime,
                              labels=labels)
        except SubmissionRefused as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"submitted {job.job_id}: {job.verdict}")
        for line in gpuq.explain(job.job_id):
            print(line)
        try:
            final = gpuq.wait(job.job_id, timeout_s=args.timeout, poll_s=args.poll)
        except WaitTimeout as exc:
            print(exc, file=sys.stderr)
            return 2
    print(f"{final['job_id']}: {final['state']}" + (f" ({final['outcome']})" if final.get("outcome") else ""))
    return 0 if final["state"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
