"""Many chats answered turn by turn by a generator or by OpenAI servers: which prompts go to
the engine together, and which chats are in flight at once (the schedules of `eyas
regenerate`'s three backends).

A chat here is the caller's object (eyas.regenerate.Conversation): `next_prompt(render)` gives
the prompt ids of its next turn, or None once it has ended (its `result` is then set), and
`take(generation)` puts the answer to that turn in. What an answer means, when a chat ends and
where its result goes (the `write`, `sync` and `collect` given here) are the caller's
business; `cfg` gives batch_size, max_new_tokens, temperature and top_p.

- A generator (eyas.serve.generator's LocalGenerator, eyas.serve.vllm_generate's
  VLLMGenerator): `answer_together` answers a fixed batch round by round; `run_windows`
  (padded and lookup batching) sorts windows of batch_size x 8 chats by length and answers
  them in batches of batch_size; `run_rolling` (engines that schedule a whole call themselves)
  keeps batch_size x 8 chats in flight and replaces each that ends at once.
- OpenAI servers (eyas.serve.openai_client's ChatClient): `run_in_threads` runs each job in a
  daemon thread of its own (`_in_daemon_thread`), `concurrency` at once.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Callable, Iterable, Iterator


def answer_together(gen, chats: list, render: Callable[[list[dict]], list[int]], cfg) -> None:
    """Answer `chats` to their ends with `gen`: round r generates the r-th turn of every chat
    that has one, in one generate call."""
    while asked := [(c, p) for c in chats if (p := c.next_prompt(render)) is not None]:
        outs = gen.generate([p for _, p in asked], cfg.max_new_tokens, cfg.temperature,
                            cfg.top_p)
        for (c, _), out in zip(asked, outs):
            c.take(out)


def run_windows(gen, chats: Iterator, render: Callable[[list[dict]], list[int]], cfg,
                write: Callable, sync: Callable[[], None]) -> None:
    """Windows of cfg.batch_size x 8 chats, answered in batches of cfg.batch_size
    (`answer_together`); write(chat) for each once its batch is done, then sync()."""
    while window := list(itertools.islice(chats, cfg.batch_size * 8)):
        # Conversations of similar length share a batch, so left padding wastes little.
        window.sort(key=lambda c: sum(len(m["content"]) for m in c.messages))
        for start in range(0, len(window), cfg.batch_size):
            batch = window[start:start + cfg.batch_size]
            answer_together(gen, batch, render, cfg)
            for c in batch:
                write(c)
            sync()


def run_rolling(gen, chats: Iterator, render: Callable[[list[dict]], list[int]], cfg,
                write: Callable, sync: Callable[[], None]) -> None:
    """A pool of cfg.batch_size x 8 chats in flight, one generate call per round over the next
    turn of each; whoever ends is written (write(chat)) and leaves the pool, and a new chat
    takes its place; sync() after each round. (With whole windows instead, a window's last
    rounds ran a handful of long chats on an idle engine.)"""
    size = cfg.batch_size * 8
    live: list = []
    more = True
    while live or more:
        if more:
            new = list(itertools.islice(chats, size - len(live)))
            more = len(new) == size - len(live)
            live += new
        asked = [(c, p) for c in live if (p := c.next_prompt(render)) is not None]
        for c in live:
            if c.result is not None:
                write(c)
        live = [c for c, _ in asked]
        if asked:
            outs = gen.generate([p for _, p in asked], cfg.max_new_tokens, cfg.temperature,
                                cfg.top_p)
            for (c, _), out in zip(asked, outs):
                c.take(out)
        sync()


def run_in_threads(jobs: Iterable, work: Callable, concurrency: int,
                   collect: Callable[[object, Future], None]) -> None:
    """work(job) for every job, each in a daemon thread of its own (`_in_daemon_thread`),
    `concurrency` at once; collect(job, future) in this thread as each ends. Whatever collect
    raises ends the run at once, abandoning the threads in flight."""
    pending: dict[Future, object] = {}

    def collect_done() -> None:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            collect(pending.pop(future), future)

    slots = threading.Semaphore(concurrency)
    for job in jobs:
        pending[_in_daemon_thread(slots, work, job)] = job
        # A bounded queue keeps memory flat and the outputs close to the input position.
        while len(pending) >= 2 * concurrency:
            collect_done()
    while pending:
        collect_done()


def _in_daemon_thread(slots: threading.Semaphore, fn, *args) -> Future:
    """fn(*args) in a daemon thread of its own, once one of `slots` is free. An interrupted
    run (Ctrl-C, the servers down) so exits at once and abandons the conversations in flight,
    which are not written and so are redone on resume; a ThreadPoolExecutor's workers were
    joined at exit, so Ctrl-C waited for every conversation in flight to end (72 s for 8 short
    ones on the tiny test server). The threads left behind stop on their own once the run
    closes its ChatClient (eyas.regenerate's openai backend)."""
    future: Future = Future()

    def run() -> None:
        with slots:
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 (the main thread re-raises it)
                future.set_exception(err)

    threading.Thread(target=run, daemon=True, name="eyas-regenerate").start()
    return future
