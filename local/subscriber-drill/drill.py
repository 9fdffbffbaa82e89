"""`./scripts/subscriber-drill`'s provider and judge.

post URL RUN HOOKCTL: 300 GitHub events of four types (issues, pull_request, push, star, in turn),
each signed by `hookctl sign --scheme github` with local/github-demo's secret (read from
local/secrets.toml), every seventh posted twice; prints the answers.
verdict LOG: reads the subscriber's log and prints what it received; exits 1 unless each of the
150 subscribed events (issues and pull_request) was accepted exactly once by webhook-id, every
request verified, and no other type arrived.
"""
import collections
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request

TYPES = ["issues", "pull_request", "push", "star"]
SUBSCRIBED = {"issues", "pull_request"}
EVENTS = 300
SECRETS_FILE = "local/secrets.toml"


def secret(ref):
    """A secret's current value as the local runner reads it (`local/secrets.toml`)."""
    with open(SECRETS_FILE, "rb") as file:
        return tomllib.load(file)["secrets"][ref]["current"]


def signed_headers(hookctl, github_secret, body):
    """The headers GitHub would sign `body` with, as `hookctl sign` prints them."""
    with tempfile.NamedTemporaryFile() as file:
        file.write(body)
        file.flush()
        printed = subprocess.run(
            [hookctl, "sign", "--scheme", "github", "--secret", github_secret, "--body", file.name],
            check=True, capture_output=True, text=True).stdout
    return dict(line.split(": ", 1) for line in printed.splitlines() if ": " in line)


def post(url, run, hookctl):
    github_secret = secret("local/github-demo")

    def one(n):
        body = json.dumps({"action": "opened", "number": n,
                           "repository": {"full_name": "demo/drill"},
                           "sender": {"login": "octocat"}}).encode()
        headers = signed_headers(hookctl, github_secret, body)
        headers.update({"content-type": "application/json", "x-github-event": TYPES[n % len(TYPES)],
                        "x-github-delivery": f"{run}-{n:04d}"})
        request = urllib.request.Request(url, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read() or b"{}").get("status")
        except urllib.error.HTTPError as error:
            return error.code, error.read()[:200].decode(errors="replace")

    deliveries = list(range(EVENTS)) + list(range(0, EVENTS, 7))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = collections.Counter(pool.map(one, deliveries))
    print(f"posted {len(deliveries)} deliveries of {EVENTS} events:",
          ", ".join(f"{n} answered {code} {status}" for (code, status), n in sorted(answers.items())))
    return 0 if set(answers) <= {(200, "accepted"), (200, "duplicate")} else 1


def tally(log):
    rows = [json.loads(line) for line in open(log)]
    tries = [r for r in rows if "id" in r]
    accepted = collections.Counter(r["id"] for r in tries if r["status"] == 200)
    return rows, tries, accepted


def verdict(log):
    rows, tries, accepted = tally(log)
    expected = sum(1 for n in range(EVENTS) if TYPES[n % len(TYPES)] in SUBSCRIBED)
    types = collections.Counter(r["type"] for r in tries)
    statuses = collections.Counter(r["status"] for r in tries)
    verified = sum(r["verified"] for r in tries)
    twice = sorted(i for i, n in accepted.items() if n > 1)
    down = [r for r in rows if "down_seconds" in r]
    print(f"subscriber: {len(tries)} requests ({', '.join(f'{n} answered {s}' for s, n in sorted(statuses.items()))}), "
          f"{verified} verified by standardwebhooks, types {dict(types)}, "
          f"down {down[0]['down_seconds'] if down else 0:g} s")
    print(f"subscribed events accepted: {len(accepted)} of {expected}, accepted twice: {len(twice)}")
    failures = []
    if len(accepted) != expected:
        failures.append(f"{len(accepted)} subscribed events accepted, not {expected}")
    if twice:
        failures.append(f"accepted more than once: {twice[:5]}")
    if verified != len(tries):
        failures.append(f"{len(tries) - verified} requests did not verify")
    if set(types) - SUBSCRIBED:
        failures.append(f"types not subscribed arrived: {sorted(set(types) - SUBSCRIBED)}")
    if not down:
        failures.append("the subscriber never went down")
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


def accepted_count(log):
    try:
        print(len(tally(log)[2]))
    except FileNotFoundError:
        print(0)
    return 0


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    sys.exit({"post": post, "verdict": verdict, "accepted": accepted_count}[command](*args))
