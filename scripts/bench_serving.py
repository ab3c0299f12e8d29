"""Online serving benchmark over OpenAI-compatible HTTP (streaming /v1/completions), so it
measures jaxrunner and any other server the same way. Prints JSON and a table.

Requests arrive at a fixed rate or as a Poisson process (`--request-rate`, inf = all at once),
with at most `--max-concurrency` in flight. Workloads: `random` (prompts of random words, random
lengths) or `shared-prefix` (groups of prompts that share a long prefix). A warm-up phase runs
first and is not counted. Counts and times are bounded: `--num-prompts`, `--max-duration`,
`--request-timeout`.

    jaxrunner serve --model-path DIR --port 30000 &
    python scripts/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 200 \
        --request-rate 8 --max-concurrency 32 --input-len 32 256 --output-len 16 128

Token counts come from the server's `usage` (stream_options.include_usage); output lengths are
exact when the server honours `ignore_eos` (jaxrunner, vLLM and SGLang do; `--no-ignore-eos`
otherwise). TTFT: request sent to first text chunk. ITL: gaps between text chunks. TPOT:
(latency - TTFT) / (output tokens - 1), per request.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time

import httpx
import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her an this which are be "
         "it or had not but have one were they their all been has when there more who will no "
         "would if so out up its time what about into than them only other some could these "
         "two may first then do any like my now over such our man me even most made after also "
         "did many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three"
         ).split()


@dataclasses.dataclass
class Request:
    prompt: str
    max_tokens: int


@dataclasses.dataclass
class Result:
    ok: bool
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itls: list = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="counted requests")
    p.add_argument("--num-warmup", type=int, default=4, help="uncounted requests first")
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   help="prompt length in words (about tokens)")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: prefix groups")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix words")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf: all "
                   "at once")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--max-duration", type=float, default=600.0,
                   help="stop sending counted requests after this many seconds")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="also write the JSON result here")
    return p.parse_args(argv)


def make_requests(args, n: int, rng: random.Random) -> list[Request]:
    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    prefixes = [words(args.prefix_len) for _ in range(args.num_groups)]
    out = []
    for i in range(n):
        prompt = words(rng.randint(*args.input_len))
        if args.workload == "shared-prefix":
            prompt = prefixes[i % args.num_groups] + " " + prompt
        out.append(Request(prompt, rng.randint(*args.output_len)))
    return out


async def send(client: httpx.AsyncClient, args, model: str, req: Request) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    res = Result(ok=False)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 timeout=args.request_timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"])
                    return res
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
                if any(c.get("text") for c in data.get("choices", [])):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = chunks > 0
    if not res.ok:
        res.error = "no text received"
    return res


async def run_phase(client, args, model, reqs, deadline: float | None) -> tuple[list, float]:
    rng = np.random.default_rng(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency)

    async def one(req):
        async with limit:
            return await send(client, args, model, req)

    tasks, start = [], time.perf_counter()
    for req in reqs:
        if deadline is not None and time.perf_counter() > deadline:
            break
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(args.request_rate):
            gap = 1.0 / args.request_rate
            await asyncio.sleep(rng.exponential(gap) if args.arrival == "poisson" else gap)
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(xs) * 1000.0  # ms
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(args, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "workload": args.workload, "request_rate": args.request_rate, "arrival": args.arrival,
        "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_token_throughput": in_tokens / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles([x for r in ok for x in r.itls]),
        "e2e_latency_ms": percentiles([r.latency for r in ok]),
    }


def print_table(s: dict) -> None:
    print(f"{'completed / failed':<28}{s['completed']} / {s['failed']}")
    print(f"{'duration (s)':<28}{s['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{s['request_throughput']:.2f}")
    print(f"{'input tokens/s':<28}{s['input_token_throughput']:.1f}")
    print(f"{'output tokens/s':<28}{s['output_token_throughput']:.1f}")
    print(f"{'(ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        row = s[name]
        cells = "".join(f"{row[k]:>10.2f}" if row[k] is not None else f"{'-':>10}"
                        for k in ("mean", "p50", "p90", "p99"))
        print(f"{name[:-3].upper():<16}{cells}")


async def main_async(args) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.max_concurrency + 8)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=30) as client:
        model = args.model
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if args.num_warmup:
            warm, _ = await run_phase(client, args, model, make_requests(args, args.num_warmup,
                                                                         rng), None)
            if not all(r.ok for r in warm):
                print(f"warm-up failed: {[r.error for r in warm if not r.ok][:3]}",
                      file=sys.stderr)
        reqs = make_requests(args, args.num_prompts, rng)
        results, duration = await run_phase(client, args, model, reqs,
                                            time.perf_counter() + args.max_duration)
    return dict(summarize(args, results, duration), model=model, base_url=args.base_url)


def main(argv=None):
    args = parse_args(argv)
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary, indent=2))
    print_table(summary)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
