#!/usr/bin/env bash
# guidellm (vLLM's streaming benchmark client, a third-party client nobody here wrote) against `jaxpage serve` on the
# default model: one 60-second run per endpoint, 4 concurrent streams, synthetic prompts of 64 tokens and 32 output
# tokens. Passes when guidellm reports 0 errored requests on both and the server logged no 4xx/5xx or traceback.
# guidellm goes into its own virtualenv (it pins other versions of some of jaxpage's dependencies).
#   bash scripts/bench_guidellm.sh [OUT_DIR]     # OUT_DIR: the reports, guidellm's output and the server log
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mkdir -p "${1:-guidellm-out}" && cd "${1:-guidellm-out}" && pwd)"
port=8123
venv="$out/venv"
[[ -x $venv/bin/guidellm ]] || { python -m venv --system-site-packages "$venv" && "$venv/bin/pip" install -q guidellm; }
tokenizer=$(python -c "
from jaxpage.tokenizers.tokenizer import load_tokenizer
import tempfile; d = tempfile.mkdtemp(); load_tokenizer().save_pretrained(d); print(d)")

python -m jaxpage serve --port "$port" --max-model-len 512 --max-num-seqs 16 > "$out/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
until [[ $(curl -s -o /dev/null -w '%{http_code}' "localhost:$port/health") == 200 ]]; do
    kill -0 "$server" || { tail -20 "$out/server.log"; exit 1; }
    sleep 5
done

status=0
for endpoint in completions chat/completions; do
    name=${endpoint//\//_}
    "$venv/bin/guidellm" run \
        --backend "kind=openai_http,target=http://localhost:$port,model=SmolLM2-135M-Instruct,request_format=/v1/$endpoint" \
        --profile kind=concurrent,streams=4 \
        --constraint kind=max_duration,seconds=60 --constraint kind=max_requests,count=100 \
        --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
        --tokenizer "kind=hf_auto,model=$tokenizer" \
        --output "kind=json,path=$out/$name.json" --output kind=console \
        --disable-console-interactive > "$out/$name.out" 2>&1 || status=1
    python - "$out/$name.json" <<'PY' || status=1
import json, sys
report = json.load(open(sys.argv[1]))
text = json.dumps(report)
errored = [int(v) for k, v in __import__("re").findall(r'"(errored)": (\d+)', text)]
print(sys.argv[1], "errored requests:", sum(errored))
sys.exit(1 if sum(errored) else 0)
PY
done
kill "$server" && wait "$server" || true
if grep -E " (4|5)[0-9][0-9]: |Traceback" "$out/server.log"; then status=1; fi
echo "guidellm: $([[ $status == 0 ]] && echo "0 errors" || echo "FAILED") (reports in $out)"
exit $status
