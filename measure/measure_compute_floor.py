"""The compute floor of a hhook-profile task: one process, one thread, no communication.

Times forward, backward and the optimizer step (the task's batch and SGD settings, as
``hhook-profile train`` times a step) and prints the median. Against a training run's
median step on the same host it bounds what any exchange can save: a step cannot drop
below this. Usage: ``python measure/measure_compute_floor.py [--model gpt] [--steps 40]``.
"""

import argparse
import statistics
import time

import torch

from hhook.profile.tasks import TASKS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=sorted(TASKS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank of hhook-profile train
    torch.manual_seed(0)
    task = TASKS[args.model]
    model = task.build()
    x_train, y_train, _, _ = task.load()
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    times = []
    for _ in range(args.warmup + args.steps):
        i = torch.randint(0, len(x_train), (task.batch_size,))
        start = time.perf_counter()
        out = model(x_train[i])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y_train[i].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    print(f"{args.model}: compute floor {1e3 * statistics.median(times[args.warmup:]):.1f} ms a step "
          f"(median of {args.steps} after {args.warmup}; 1 process, 1 thread, batch {task.batch_size})")


if __name__ == "__main__":
    main()
