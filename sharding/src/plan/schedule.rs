//! The schedule of one optimizer step as data: every gather, unit computation and gradient
//! reduction in the order the engine performs them. The engine executes exactly this list
//! (`engine/step.rs` walks it event by event), and the plan's per-step traffic and memory are folds
//! over the same list, so the prediction and the run cannot drift apart. Pure functions of the
//! plan; nothing here communicates or allocates tensors.

use serde::Serialize;

use crate::config::{Compute, GradQuant, Recompute, Span};
use crate::plan::{Collective, Levels, Memory, Plan, TrafficTable, Visit};
use ember_comm::counters::Op;
use ember_comm::quant::{QuantFormat, Quantized};

/// Where a gather takes a unit's parameters from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Source {
    /// The primary partition, over the gradient path's hops (outermost first).
    Primary,
    /// The primary partition, keeping this rank's slice of the result as the secondary copy
    /// for the rest of the step (hpZ: no extra traffic).
    PrimaryToSecondary,
    /// The secondary copy, gathered over its (smaller) group.
    Secondary,
}

/// One thing the engine does in a step, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Event {
    /// Hand the communication thread a gather of `unit`, for the next visit that needs it
    /// (issued `prefetch` visits ahead).
    Gather {
        /// The unit gathered.
        unit: usize,
        /// Where from.
        source: Source,
    },
    /// Compute one unit visit with partitioned parameters: take its gathers, run it, release
    /// them.
    Visit(Visit),
    /// Run micro-batch `micro` through every unit in one autodiff graph (replicated
    /// parameters: nothing is released, so nothing is recomputed).
    Whole {
        /// The micro-batch.
        micro: usize,
    },
    /// Hand the communication thread `unit`'s complete gradient, to be reduced to this rank's
    /// optimizer shard.
    Reduce {
        /// The unit reduced.
        unit: usize,
        /// Only the hops up to the accumulation span run, adding into the step's accumulated
        /// gradient (every micro-batch but the last, when gradients accumulate inside the
        /// path: [`Plan::accumulated_hops`]).
        inner_only: bool,
    },
}

impl Plan {
    /// Whether a forward visit of `stage` keeps its autodiff graph (activations and gathered
    /// parameters) for its backward visit, which then neither gathers nor recomputes. The
    /// last stage runs only in its backward visit.
    pub fn keeps_graph(&self, stage: usize) -> bool {
        self.config.params() != Span(0)
            && self.config.recompute_done() == Recompute::None
            && stage + 1 < self.units.len()
    }

    /// The events of one optimizer step of `grad_accum` micro-batches.
    pub fn schedule(&self, grad_accum: usize) -> Vec<Event> {
        let cfg = &self.config;
        let k = self.units.len();
        let mut out = Vec::new();
        let accumulates = self.accumulated_hops().is_some();
        let inner_only = |micro: usize| accumulates && micro + 1 < grad_accum;
        if cfg.params() == Span(0) {
            for micro in 0..grad_accum {
                out.push(Event::Whole { micro });
                if cfg.shard_grads() {
                    out.extend((0..k).map(|unit| Event::Reduce {
                        unit,
                        inner_only: inner_only(micro),
                    }));
                }
            }
        } else {
            let visits = self.visits(grad_accum);
            let mut has_secondary = vec![false; k];
            let mut issued = 0;
            for (i, v) in visits.iter().enumerate() {
                // This visit's gathers and those of the next `prefetch` visits are in flight
                // (or done) while this one computes.
                while issued <= (i + cfg.prefetch).min(visits.len() - 1) {
                    let next = visits[issued];
                    if next.backward && self.keeps_graph(next.stage) {
                        // Its forward's graph still holds the parameters.
                        issued += 1;
                        continue;
                    }
                    for &unit in &self.units[next.stage].needs {
                        let source = match self.secondary() {
                            None => Source::Primary,
                            Some(_) if has_secondary[unit] => Source::Secondary,
                            Some(_) => {
                                has_secondary[unit] = true;
                                Source::PrimaryToSecondary
                            }
                        };
                        out.push(Event::Gather { unit, source });
                    }
                    issued += 1;
                }
                out.push(Event::Visit(*v));
                if v.backward && cfg.shard_grads() {
                    for &unit in &self.units[v.stage].needs {
                        if self.units[unit].grad_ready_at == v.stage {
                            out.push(Event::Reduce {
                                unit,
                                inner_only: inner_only(v.micro),
                            });
                        }
                    }
                }
            }
        }
        if !cfg.shard_grads() {
            out.extend((0..k).map(|unit| Event::Reduce {
                unit,
                inner_only: false,
            }));
        }
        out
    }

    /// The collectives of one event of the schedule, in the order they run (none for visits).
    pub fn collectives(&self, event: Event) -> Vec<Collective> {
        match event {
            Event::Gather { unit, source } => match (source, self.secondary()) {
                (Source::Secondary, Some(span)) => self.gather_secondary_collectives(unit, span),
                _ => self.gather_primary_collectives(unit),
            },
            Event::Reduce { unit, inner_only } => self.reduce_collectives(unit, inner_only),
            Event::Visit(_) | Event::Whole { .. } => Vec::new(),
        }
    }

    /// The collectives the calling thread runs after the schedule: the parameter all-gather
    /// after the update when parameters are replicated but optimizer state is not (outermost
    /// hop first), then the gradient norm over the optimizer group and the step's loss over
    /// the world (one f32 each).
    pub fn closing_collectives(&self) -> Vec<Collective> {
        let cfg = &self.config;
        let mut out = Vec::new();
        if cfg.params() == Span(0) && cfg.optimizer() != Span(0) {
            // Replicated parameters are rebuilt from the updated master shards.
            let c = cfg.compute.bytes();
            for u in 0..self.units.len() {
                let mut per_rank = self.shard_len(u, cfg.optimizer()) * c;
                for hop in self.hops().into_iter().rev() {
                    let g = hop.size(&self.topology);
                    if g > 1 {
                        out.push(Collective::new(hop, Op::AllGather, (per_rank * g) as u64));
                        per_rank *= g;
                    }
                }
            }
        }
        for group in [
            self.group(cfg.optimizer()),
            self.group(Span(self.topology.depth())),
        ] {
            if group.size(&self.topology) > 1 {
                out.push(Collective::new(group, Op::AllReduce, 4));
            }
        }
        out
    }

    /// Bytes one rank moves per (group, op) in one optimizer step: the schedule's gathers and
    /// reductions, then the step's closing collectives.
    pub fn traffic(&self, grad_accum: usize) -> TrafficTable {
        let mut t = TrafficTable::new();
        let events = self.schedule(grad_accum);
        for c in events
            .iter()
            .flat_map(|&e| self.collectives(e))
            .chain(self.closing_collectives())
        {
            c.charge(&self.topology, &mut t);
        }
        t
    }

    /// Whether the primary partition is the f32 master itself (no copy is kept).
    pub fn primary_is_master(&self) -> bool {
        self.config.compute == Compute::F32 && self.config.params() == self.config.optimizer()
    }

    /// Bytes one rank holds in a step of `grad_accum` micro-batches, predicted by walking the
    /// schedule (see [`Memory`]).
    ///
    /// The working set follows the engine event by event: a gather holds its unit from the
    /// moment it is issued until the visit that used it ends (its staging copy only while it
    /// runs); a backward visit holds autodiff's parameter gradients and the unit's flat
    /// gradient; a handed-off gradient stays until the reduction ends, modelled as the end of
    /// the next visit (the communication thread reduces while the next unit computes), with a
    /// staging copy; activations are the unit boundaries a micro-batch keeps for backward plus
    /// the graph of the unit computing.
    pub fn memory(&self, grad_accum: usize) -> Memory {
        let cfg = &self.config;
        let c = cfg.compute.bytes() as u64;
        let k = self.units.len();
        let padded = |u: usize| self.units[u].padded as u64;
        let sum = |f: &dyn Fn(usize) -> u64| (0..k).map(f).sum::<u64>();
        let params = if self.primary_is_master() {
            0
        } else {
            sum(&|u| self.shard_len(u, cfg.params()) as u64 * c)
        };
        let secondary = self
            .secondary()
            .map_or(0, |s| sum(&|u| self.secondary_bytes(u, s) as u64));
        let grads = if cfg.shard_grads() {
            sum(&|u| 4 * self.shard_len(u, cfg.optimizer()) as u64)
        } else {
            sum(&|u| 4 * padded(u))
        };
        // Gradients accumulating inside the path: an f32 shard per unit at that span.
        let grads = grads
            + match self.accumulated_hops().and(cfg.accumulate()) {
                Some(span) if grad_accum > 1 => sum(&|u| 4 * self.shard_len(u, span) as u64),
                _ => 0,
            };
        let optimizer = sum(&|u| 12 * self.shard_len(u, cfg.optimizer()) as u64);
        let residuals = if cfg.error_feedback() && cfg.quantize_grads() != GradQuant::Off {
            sum(&|u| {
                let mut len = padded(u);
                let mut bytes = 0;
                for hop in self.hops() {
                    let g = hop.size(&self.topology) as u64;
                    if g > 1 {
                        bytes += 4 * len;
                        len /= g;
                    }
                }
                bytes
            })
        } else {
            0
        };

        // Staging while a gather runs: the int8 wire bytes gathered (and their hop-order
        // copy); an unquantized gather over several hops also reorders a whole copy.
        let live_hops = self
            .hops()
            .iter()
            .filter(|h| h.size(&self.topology) > 1)
            .count();
        let gather_staging = |u: usize, source: Source| -> u64 {
            match (self.quantizes_weights(), source) {
                (true, _) => {
                    let wire = Quantized::wire_bytes(
                        QuantFormat::Int8,
                        self.block(),
                        self.units[u].padded,
                    ) as u64;
                    let copies = if live_hops > 1 && source != Source::Secondary {
                        2
                    } else {
                        1
                    };
                    // Dequantized in f32, then cast when computing in bf16.
                    copies * wire + if c == 4 { 0 } else { 4 * padded(u) }
                }
                (false, Source::Secondary) => 0,
                (false, _) if live_hops > 1 => padded(u) * c,
                (false, _) => 0,
            }
        };
        // A reduction's staging: an all-reduce's result and its mean (replicated optimizer
        // state); the hop-ordered copy of a reduce-scatter over several hops; quantized, the
        // hop-ordered copy and the residual's and dequantized temporaries.
        let reduce_staging = |u: usize| -> u64 {
            match cfg.quantize_grads() {
                _ if cfg.optimizer() == Span(0) => 8 * padded(u),
                GradQuant::Off if live_hops > 1 => 4 * padded(u),
                GradQuant::Off => 0,
                _ => 8 * padded(u),
            }
        };
        let act = &self.activations;
        // A gathered unit is held in the compute dtype until a visit builds its module; with
        // f32 modules over bf16 parameters the visit widens it (the bf16 buffer goes as its
        // f32 copy is made), and a kept graph holds the f32 copy.
        let widened = self.module_dtype != cfg.compute;
        let m = self.module_dtype.bytes() as u64;

        let mut gathered = 0u64; // whole units gathered and not yet released
        let mut in_flight: Vec<usize> = Vec::new(); // units gathered, in request order
        let mut kept: Vec<usize> = Vec::new(); // units a kept forward graph holds
        // Gradients handed off and not yet reduced, with their reductions' staging.
        let mut reducing: Vec<(u64, u64)> = Vec::new();
        let mut work = vec![0u64; k]; // flat unit gradients being assembled
        let mut boundaries = 0u64; // unit outputs a micro-batch keeps for backward
        let mut gathered_peak = 0u64;
        let mut activations_peak = 0u64;
        let mut working_peak = 0u64;
        let mut note = |extra: u64, activations: u64, g: u64, w: u64| {
            gathered_peak = gathered_peak.max(g);
            activations_peak = activations_peak.max(activations);
            working_peak = working_peak.max(w + extra);
        };
        // Each group's thread works on one stage at a time, so as many reductions as there are
        // hops hold their staging at once (the largest ones, at worst); every handed-off
        // gradient is held until its reduction ends.
        let at_once = live_hops.max(1);
        let largest = |stagings: &mut dyn Iterator<Item = u64>| -> u64 {
            let mut v: Vec<u64> = stagings.collect();
            v.sort_unstable_by(|a, b| b.cmp(a));
            v.iter().take(at_once).sum()
        };
        let working = |g: u64, work: &[u64], reducing: &[(u64, u64)], b: u64| {
            g + work.iter().sum::<u64>()
                + reducing.iter().map(|r| r.0).sum::<u64>()
                + largest(&mut reducing.iter().map(|r| r.1))
                + b
        };
        // Gathers in flight and their staging, likewise pipelined over the hops.
        let mut gather_stagings: Vec<(usize, u64)> = Vec::new();
        for event in self.schedule(grad_accum) {
            match event {
                Event::Gather { unit, source } => {
                    gathered += padded(unit) * c;
                    in_flight.push(unit);
                    gather_stagings.push((unit, gather_staging(unit, source)));
                    let w = working(gathered, &work, &reducing, boundaries);
                    let staging = largest(&mut gather_stagings.iter().map(|g| g.1));
                    note(staging, boundaries, gathered, w);
                }
                Event::Visit(v) => {
                    let needs = &self.units[v.stage].needs;
                    let a = &act[v.stage];
                    let keep = self.keeps_graph(v.stage);
                    if !(v.backward && keep) {
                        // The visit's module, from the units gathered for it.
                        for &u in needs {
                            gathered = gathered - padded(u) * c + padded(u) * m;
                        }
                    }
                    let graph = if v.backward && keep {
                        // Backward through the kept graph: the gradients of its activations,
                        // the upstream gradient and autodiff's parameter gradients.
                        for &u in needs {
                            work[u] = 4 * padded(u);
                        }
                        a.saved + a.output + needs.iter().map(|&u| 4 * padded(u)).sum::<u64>()
                    } else if v.backward {
                        // The recompute with autodiff, then backward's gradients of those
                        // activations (a unit's own graph is all of it, so they add up: about
                        // twice `saved`, measured), the upstream gradient, and autodiff's
                        // parameter gradients beside the flat ones being assembled.
                        for &u in needs {
                            work[u] = 4 * padded(u);
                        }
                        2 * a.saved + a.output + needs.iter().map(|&u| 4 * padded(u)).sum::<u64>()
                    } else {
                        a.saved + a.output
                    };
                    let w = working(gathered, &work, &reducing, boundaries);
                    note(graph, boundaries + a.saved + a.output, gathered, w);
                    // The visit ends: its gathers are released (a kept forward graph holds
                    // them until its backward visit), the reductions handed off before it
                    // have finished, and its boundary is kept or consumed.
                    for &u in needs {
                        if keep && v.backward {
                            let at = kept.iter().position(|&x| x == u).expect("kept by forward");
                            kept.remove(at);
                            gathered -= padded(u) * m;
                            continue;
                        }
                        let at = in_flight
                            .iter()
                            .position(|&x| x == u)
                            .expect("a visit's gathers were issued before it");
                        in_flight.remove(at);
                        if let Some(at) = gather_stagings.iter().position(|g| g.0 == u) {
                            gather_stagings.remove(at);
                        }
                        if keep {
                            kept.push(u);
                        } else {
                            gathered -= padded(u) * m;
                        }
                    }
                    reducing.clear();
                    if keep {
                        // The graph's activations live from the forward visit to the backward.
                        if v.backward {
                            boundaries -= a.saved;
                        } else {
                            boundaries += a.saved;
                        }
                    }
                    if v.backward {
                        if v.stage > 0 {
                            boundaries -= act[v.stage - 1].output;
                        }
                        for &u in needs {
                            if !cfg.shard_grads() && self.units[u].grad_ready_at == v.stage {
                                // Added into the step's whole-gradient buffer (`grads`).
                                work[u] = 0;
                            }
                        }
                    } else {
                        boundaries += a.output;
                    }
                }
                Event::Whole { .. } => {
                    // One graph: backward frees each unit's activations as it produces that
                    // unit's gradients, so the peak is the larger of the activations and the
                    // gradients at the end (whole unit buffers are assembled one unit at a
                    // time; with unpartitioned gradients they are the step's `grads`).
                    let acts: u64 = act.iter().map(|a| a.saved + a.output).sum();
                    let largest = (0..k).map(padded).max().unwrap_or(0);
                    let grads_built = 4 * largest
                        + if cfg.shard_grads() {
                            sum(&|u| 4 * padded(u))
                        } else {
                            0
                        };
                    // With f32 modules over bf16 parameters, the f32 copy of every unit.
                    let widened_copy = if widened { sum(&|u| 4 * padded(u)) } else { 0 };
                    let graph = acts.max(grads_built) + widened_copy;
                    let w = working(gathered, &work, &reducing, boundaries);
                    note(graph, acts, gathered, w);
                    if cfg.shard_grads() {
                        for (u, w) in work.iter_mut().enumerate() {
                            *w = 4 * padded(u);
                        }
                    }
                }
                Event::Reduce { unit, .. } => {
                    let handed = if cfg.shard_grads() {
                        std::mem::take(&mut work[unit])
                    } else {
                        0
                    };
                    reducing.push((handed, reduce_staging(unit)));
                    let w = working(gathered, &work, &reducing, boundaries);
                    note(0, boundaries, gathered, w);
                }
            }
        }
        // AdamW, unit by unit: the new master and moments and the update's temporaries beside
        // the old ones, about 20 bytes per element of the largest optimizer shard (measured:
        // ddp at 8 ranks, whose shards are whole units, peaked that much above the step).
        let update = (0..k)
            .map(|u| 20 * self.shard_len(u, cfg.optimizer()) as u64)
            .max()
            .unwrap_or(0);
        // Each communication thread allocates from a heap arena of its own, which keeps its
        // last job's staging for reuse (glibc; measured: hier3 at 2 ranks peaked 1.26-1.30x a
        // plan without this). One thread per group that moves data, per lane.
        let moves = |g: &Levels| g.size(&self.topology) > 1;
        let mut gather_groups: Vec<Levels> = Vec::new();
        let mut reduce_groups: Vec<Levels> = Vec::new();
        for event in self.schedule(grad_accum) {
            let list = match event {
                Event::Gather { .. } => &mut gather_groups,
                Event::Reduce { .. } => &mut reduce_groups,
                _ => continue,
            };
            for c in self.collectives(event) {
                if moves(&c.group) && !list.contains(&c.group) {
                    list.push(c.group);
                }
            }
        }
        let largest_gather = (0..k)
            .map(|u| gather_staging(u, Source::Primary))
            .max()
            .unwrap_or(0);
        let largest_reduce = (0..k).map(reduce_staging).max().unwrap_or(0);
        let heaps = gather_groups.len() as u64 * largest_gather
            + reduce_groups.len() as u64 * largest_reduce;
        Memory {
            params,
            secondary,
            grads,
            optimizer,
            residuals,
            gathered_peak,
            activations_peak,
            working_peak: working_peak.max(update) + heaps,
            checkpoint_staging: 0,
        }
    }
}
