#!/usr/bin/env bash
# Which ways of starting a CUDA process work on this machine (PID namespace, private /proc)?
for variant in "" "unshare --pid --fork" "unshare --pid --fork --mount-proc"; do
  printf '%-40s ' "${variant:-plain}"
  $variant python3 -c "import torch; print('ok', torch.zeros(1).cuda().item())" 2>&1 | tail -1
done
