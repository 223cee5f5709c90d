"""Supervised fine-tuning with the train step on Metaflow `@pytorch_parallel` tasks, one rank each.

    python flows/sft_multinode_flow.py --config config configs/sft/tiny-2workers.yaml run
    python flows/sft_multinode_flow.py --config config configs/sft/tiny-2workers.yaml run --with kubernetes

The same recipe, config parser and steps as `SFTFlow` (flows/sft_flow.py), which this flow
inherits: start, ingest, tokenize, pack, verify, the evaluation foreach, register and end
are SFTFlow's.
Only training differs. SFTFlow trains `parallel.num_workers` ranks as Ray actors inside one
task; here each rank is its own Metaflow task, so on a cluster each runs on its own node:

    pack -> train -> train_nodes (x parallel.num_workers) -> join_nodes -> verify -> ...

- `train` runs once: it refuses recipes the workers cannot train and writes the starting
  weights to `<run dir>/base` (`node_training.prepare`), then fans out with
  `num_parallel=parallel.num_workers`.
- `train_nodes` (`@pytorch_parallel`) runs `steps.train.train_loop` as rank
  `current.parallel.node_index` of a process group rooted at the control task
  (`node_training.train_this_node`). Rank 0, the control task, shows the live training card,
  writes metrics and the export, and stores the training artifacts (`history`,
  `train_summary`, `checkpoint_dir`, ...) that SFTFlow's train step stores.
- `join_nodes` merges them for the rest of the flow.

Locally, Metaflow starts the other tasks as subprocesses of the control task with the
`python` found on PATH (put the project virtualenv first). On a scheduler
(`--with kubernetes`, `--with batch`) they are separate pods/nodes started together; the
run directory (`output_dir`) must then be storage every node sees.

Checkpoints and resume as in SFTFlow: every rank takes part in checkpoints under
`<output_dir>/SFTMultinodeFlow/<run id>/train_state/`, and a retried (`@retry`: all the
step's tasks start again) or resumed train step continues from the newest complete one:

    python flows/sft_multinode_flow.py resume train_nodes
"""

from metaflow import card, current, pytorch_parallel, retry, step

from posttrain.steps import node_training

import recipe_cards as cards
from sft_flow import SFTFlow


class SFTMultinodeFlow(SFTFlow):
    @step
    def train(self):
        """Check the recipe and write the starting model once, then start one task per worker."""
        self.train_start = node_training.prepare(self.recipe, self._tokenizer(), self.run_dir)
        self.next(self.train_nodes, num_parallel=self.recipe.parallel.num_workers)

    @retry(times=1, minutes_between_retries=0)
    @card(type="blank", id="training", refresh_interval=5)
    @pytorch_parallel
    @step
    def train_nodes(self):
        """One rank of the training loop per task; the control task (rank 0) stores the results
        and its card shows loss and throughput live."""
        from posttrain.steps import train

        lead = current.parallel.node_index == 0
        on_step = None
        if lead:
            total = train.total_steps_for(self.pack_stats.num_rows, self.recipe)
            on_step = cards.LiveTrainingCard(cards.card("training"), total, self.recipe.train.card_refresh_s)
        else:
            cards.card("training").append(cards.Markdown(
                f"Rank {current.parallel.node_index} of {current.parallel.num_nodes}: "
                "the control task's card shows training."))
        result = node_training.train_this_node(current.parallel, self.recipe, self._tokenizer(), self.samples,
                                               self.pack_stats.num_rows, self.run_dir, self.train_start,
                                               on_step=on_step)
        if lead:  # the other ranks set no artifact, so join_nodes merges rank 0's
            self._store_train_result(result)
        self.next(self.join_nodes)

    @step
    def join_nodes(self, inputs):
        """Carry rank 0's training artifacts (and the recipe's) on to verification."""
        self.merge_artifacts(inputs)
        self.next(self.verify)


if __name__ == "__main__":
    SFTMultinodeFlow()
