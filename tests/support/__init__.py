"""What the tests share (no test module imports another): each module named for what it holds."""
