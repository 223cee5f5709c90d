"""What each recipe optimises, on the objective contract of `posttrain.train.objective`:
`sft` (next-token cross-entropy over assistant tokens)."""
