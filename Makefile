VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup serve test bench models
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) scripts/install.sh
	touch $@

serve: setup            ## start the server with the built-in model
	$(VENV)/bin/leapfrog serve

test: setup             ## run the test suite (the import layering first)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests

bench: setup
	$(VENV)/bin/leapfrog bench

# Retrain every built-in model from ../shared/data, in dependency order (hours to days on 2 CPU
# cores). Each step resumes its own run (--resume) and leaves a marker in runs/done/ when it has
# finished, so `make models` run again, in a later session, continues where it stopped; `make -n
# models` lists what is left. The commands are the ones docs/models.md reports numbers for.
LF := $(VENV)/bin/leapfrog
DONE := runs/done
DRAFTERS := dspark-markov-2l dflash-2l dspark-rnn-2l dflash-5l
.PRECIOUS: $(DONE)/%          # the markers are the record of what is done: never deleted as intermediates
DIFFUSION := stories-diffusion stories-diffusion-mb stories-diffusion-distill stories-diffusion-distill2 \
	stories-diffusion-stream

# The models the benchmarks measure first; then couplets (nothing derives from it); last the two
# drafter variants only the comparison tables use (nothing grows from them).
models: $(DONE)/stories-large $(DONE)/stories-diffusion-stream $(DONE)/stories-moe $(DONE)/couplets \
	$(DONE)/stories-clover $(DONE)/drafter-variants   ## retrain the built-in models (resumable)

$(DONE)/stories-run: | setup
	$(LF) train stories --resume
	@mkdir -p $(DONE) && touch $@

$(DONE)/stories-polish: $(DONE)/stories-run
	$(LF) train stories-polish --resume
	@touch $@

$(DONE)/stories-unrepeat: $(DONE)/stories-polish
	$(LF) train stories-unrepeat --resume
	@touch $@

$(DONE)/stories: $(DONE)/stories-unrepeat
	$(LF) train stories-context --resume
	@touch $@

$(DONE)/stories-moe: | $(DONE)/stories
	$(LF) train stories-moe --resume
	@touch $@

# stories-clover: stories-moe grown to 32 experts, then the block-diffusion stages; stage 5 ships,
# written in LLaDA2-MoE's layout (docs/models.md, "stories-clover").
$(DONE)/stories-clover: $(DONE)/stories-moe
	$(LF) train stories-clover --threads 2 --resume
	$(LF) train stories-clover-mb --threads 2 --resume
	$(LF) train stories-clover-distill --threads 2 --resume
	$(LF) train stories-clover-greedy --threads 2 --resume
	$(LF) train stories-clover-greedy-mb --threads 2 --resume
	$(PY) -m leapfrog.train.clover runs/stories-clover-greedy-mb/model checkpoints/stories-clover
	@touch $@

$(DONE)/couplets: | $(DONE)/stories
	$(LF) train couplets --resume
	@touch $@

$(DONE)/drafter-%: $(DONE)/stories
	$(LF) train drafter $* --steps 2000 --num-regen 6400 --threads 2 --resume
	@touch $@

$(DONE)/stories-diffusion: $(DONE)/stories
	$(LF) train stories-diffusion --threads 2 --resume
	@touch $@
$(DONE)/stories-diffusion-mb: $(DONE)/stories-diffusion
	$(LF) train stories-diffusion-mb --threads 2 --resume
	@touch $@
$(DONE)/stories-diffusion-distill: $(DONE)/stories-diffusion-mb
	$(LF) train stories-diffusion-distill --threads 2 --resume
	@touch $@
$(DONE)/stories-diffusion-distill2: $(DONE)/stories-diffusion-distill
	$(LF) train stories-diffusion-distill2 --threads 2 --resume
	@touch $@
$(DONE)/stories-diffusion-stream: $(DONE)/stories-diffusion-distill2
	$(LF) train stories-diffusion-stream --threads 2 --resume
	@touch $@

# stories-large is grown from stories on first use and trained further as a low-rank delta that
# ships in its recipe folder; stories-large-diffusion is grown from stories-diffusion-plain. Their
# recipes then need the checksums of what they now build.
$(DONE)/stories-large-delta: $(DONE)/stories
	$(LF) train stories-large --resume
	@touch $@

# Its default (narrow) drafters start as stories' drafters read through the wider features (built
# --derived: not the copy shipped before), then are distilled against stories-large itself and
# shipped in its recipe folder (7 MB each).
$(DONE)/large-drafter-%: $(DONE)/stories-large-delta $(DONE)/drafter-%
	$(PY) -m leapfrog.checkpoint.build --write-sums checkpoints/stories-large
	$(PY) -m leapfrog.checkpoint.build --derived checkpoints/stories-large runs/stories-large-derived-$*
	$(LF) train drafter $* --target stories-large --steps 600 --num-regen 3200 --threads 2 --resume \
		--init-from runs/stories-large-derived-$*/drafters/$*-narrow \
		--out checkpoints/stories-large/drafters/$*-narrow --run-dir runs/drafter-stories-large-$*
	$(PY) -m leapfrog.checkpoint.build --ship-drafter checkpoints/stories-large drafters/$*-narrow
	@touch $@

# The DSpark one sits on DFlash's block (anchor + 8 masks: its first draft comes from a mask's slot,
# not the anchor's): it starts from the DFlash drafter's backbone and stories' DSpark heads
# (docs/models.md, "DSpark on DFlash's block").
$(DONE)/large-drafter-dspark-markov-2l: $(DONE)/stories-large-delta $(DONE)/drafter-dspark-markov-2l \
		$(DONE)/drafter-dflash-2l
	$(PY) -m leapfrog.checkpoint.build --write-sums checkpoints/stories-large
	$(PY) -m leapfrog.checkpoint.build --derived checkpoints/stories-large runs/stories-large-derived-dspark-markov-2l
	$(LF) train drafter dspark-markov-2l --target stories-large --block masks --steps 600 \
		--num-regen 1200 --seed 4321 --threads 2 --resume \
		--init-from runs/stories-large-derived-dspark-markov-2l/drafters/dflash-2l-narrow \
		--heads-from runs/stories-large-derived-dspark-markov-2l/drafters/dspark-markov-2l-narrow \
		--out checkpoints/stories-large/drafters/dspark-markov-2l-narrow \
		--run-dir runs/drafter-stories-large-dspark-markov-2l
	$(PY) -m leapfrog.checkpoint.build --ship-drafter checkpoints/stories-large drafters/dspark-markov-2l-narrow
	@touch $@

$(DONE)/stories-large: $(DONE)/large-drafter-dspark-markov-2l $(DONE)/large-drafter-dflash-2l \
		$(DONE)/stories-diffusion-distill2
	$(PY) -m leapfrog.checkpoint.build --write-sums checkpoints/stories-large checkpoints/stories-large-diffusion
	@touch $@

$(DONE)/drafter-variants: $(DONE)/drafter-dspark-rnn-2l $(DONE)/drafter-dflash-5l
	@touch $@
