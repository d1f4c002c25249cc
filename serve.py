# An OpenAI-compatible chat server for a MARS checkpoint (docs/serving.md). The engine, its batching and
# the HTTP layer live in mars/serve.py; this is the command a user types.
#
#   python serve.py --ckpt runs/demo/mars --port 8000
from mars.serve import main

if __name__ == "__main__":
    main()
