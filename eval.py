# Scores a checkpoint on a benchmark under several decoding modes in one run: accuracy, tokens per forward
# and speed against AR, side by side (mars/eval.py holds the tasks, the sandbox and the timing).
#
#   python eval.py --ckpt DIR --task humaneval --modes ar 0.9 verify --batch-size 8 --out results/x.json
import torch

from mars.eval import main

if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
