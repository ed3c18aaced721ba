#!/usr/bin/env bash
# The HTML page of `memsave trace`, checked in a real browser: renders the seed
# network's page in headless Chromium (installed with apt-get when missing), asserts
# from the dumped DOM that the timeline and the top-tensors table are there, asserts
# that the page named no URL and made no network request (Chromium's net log), and
# writes a screenshot to target/trace-check/seed-trace.png for people to look at.
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/trace-check
mkdir -p "$out"
die() { echo "check-trace-html: $*" >&2; exit 1; }

browser="$(command -v chromium || command -v chromium-browser || true)"
if [[ -z "$browser" ]]; then
    echo "check-trace-html: installing chromium with apt-get" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    browser="$(command -v chromium)" || die "chromium did not install"
fi

page="$out/seed-trace.html"
cargo run -q -p memsave-bench --bin memsave -- trace seed --model seed-residual \
    --strategy baseline --html "$page" --top 10 >"$out/seed-trace.txt"

# The page itself names no URL and forbids loading anything.
if grep -Eo "https?://[^\"' <]*" "$page"; then
    die "$page names a URL (above): the page must be self-contained"
fi
grep -q "default-src 'none'" "$page" || die "$page has no Content-Security-Policy default-src 'none'"

url="file://$PWD/$page"
flags=(--headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --disable-default-apps)
"$browser" "${flags[@]}" --enable-logging=stderr --log-net-log="$out/netlog.json" --dump-dom "$url" >"$out/dom.html" 2>"$out/chromium.log" \
    || die "chromium failed to render $page (see $out/chromium.log)"

grep -q '<svg id="timeline"' "$out/dom.html" || die "the DOM has no timeline svg"
areas="$(grep -c '<polygon class="area"' "$out/dom.html" || true)"
(( areas >= 3 )) || die "the timeline has $areas category areas, expected at least 3"
grep -q 'id="peak"' "$out/dom.html" || die "the timeline marks no peak"
grep -q '<table id="top-tensors"' "$out/dom.html" || die "the DOM has no top-tensors table"
rows="$(grep -o '<tr>' "$out/dom.html" | wc -l)"
(( rows >= 11 )) || die "the top-tensors table has $((rows - 1)) rows, expected 10"
grep -q 'saved_activation' "$out/dom.html" || die "no saved_activation in the page"

# Requests the page made, from Chromium's net log: the browser's own background traffic
# (update checks, time sync) has no initiator ("not an origin"); a request from the
# page has the page's origin as initiator ("null" for a file, or file://...).
[[ -s "$out/netlog.json" ]] || die "chromium wrote no net log"
grep -q 'seed-trace.html' "$out/netlog.json" || die "the net log does not show the page being loaded"
if grep -E '"initiator":"(null|file:[^"]*)"' "$out/netlog.json" | grep -Eo '"url":"[a-z]+://[^"]*"' | grep -v '"url":"file://'; then
    die "the page made network requests (above)"
fi
# And nothing the Content-Security-Policy had to refuse.
if grep -E "Refused to|Content Security Policy" "$out/chromium.log"; then
    die "the page tried to load something (above)"
fi

"$browser" "${flags[@]}" --hide-scrollbars --window-size=1040,1100 \
    --screenshot="$out/seed-trace.png" "$url" >>"$out/chromium.log" 2>&1 \
    || die "chromium failed to take the screenshot (see $out/chromium.log)"
[[ -s "$out/seed-trace.png" ]] || die "no screenshot written"
echo "check-trace-html: ok: timeline ($areas areas), top-tensors table, no network request; screenshot $out/seed-trace.png"
