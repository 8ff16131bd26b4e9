//! The step time a plan predicts on a profile's machine: the engine's threads replayed over the
//! plan's schedule (the same events the engine executes), with every collective timed on the
//! profile's links (`network`), every unit visit on its compute rate, and, where the profile
//! says the ranks share CPU cores, every thread's work on its share of them.
//!
//! What it replays, as the engine does it:
//! - the training thread walks the schedule: it hands gathers and reductions over as they come,
//!   waits for a visit's gathers, computes the visit; after the last visit it waits for the
//!   reductions, runs the closing collectives and the optimizer step;
//! - every gather and reduction is a chain of collectives, one per group; each group has one
//!   thread per lane (gathers, reductions) that runs its stages one at a time in the order
//!   they were handed over, so consecutive jobs overlap on different links;
//! - stages that run at once share the links they both use, max-min fairly: a stage bound on
//!   another level (a gather across nodes on its uplinks) takes only the share of a GPU link
//!   it can use, and the stages that want more split the rest equally; a link whose
//!   direction then carries several flows runs at the level's rate for several flows;
//! - with a CPU profile, the training thread and the stages share the rank's cores, max-min
//!   fairly: a stage needs CPU in proportion to its bytes (the TCP/IP stack, copies,
//!   quantization), and the training thread takes what is left.
//!
//! It models one rank: every rank runs the same schedule on symmetric links.

use std::collections::{HashMap, VecDeque};

use serde::Serialize;

use crate::plan::network::Network;
use crate::plan::profile::Profile;
use crate::plan::schedule::Event;
use crate::plan::{Levels, Plan};

/// A step as the replay saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    /// Seconds from the step's start to the end of its optimizer step.
    pub step_s: f64,
    /// Seconds the training thread waited for gathers and reductions, plus the closing
    /// collectives (what the engine reports as `comm_wait_s`).
    pub comm_wait_s: f64,
    /// Seconds the training thread computed (visits and the optimizer step).
    pub compute_s: f64,
    /// Bytes over all links of each level in the step, both directions.
    pub link_bytes: Vec<f64>,
    /// What ran when: every visit of the training thread and every stage of a gather or
    /// reduction, in the order they ended.
    pub spans: Vec<Interval>,
}

/// One thing that ran, in a step ([`crate::StepReport::timeline`]) or in the plan's replay of
/// it, from `start` to `end` seconds into the step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Interval {
    /// `visit f3` (forward of stage 3), `visit b3`, `whole 0`, `gather 3 node`, `reduce 3 gpu`.
    pub what: String,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// One stage of a gather or reduction: its thread's group, and what it costs alone.
#[derive(Debug, Clone)]
struct Stage {
    name: String,
    group: Levels,
    latency_s: f64,
    transfer_s: f64,
    busy_s: Vec<f64>,
    /// Per level: the most flows it puts on one direction of one link.
    flows: Vec<usize>,
    /// Core-seconds of CPU work (zero without a CPU profile).
    cpu_s: f64,
}

/// A gather or reduction being replayed.
struct Job {
    stages: Vec<Stage>,
    /// Stages finished.
    done: usize,
    /// When its last stage ended.
    finished: Option<f64>,
}

/// A stage running on its thread.
struct Transfer {
    job: usize,
    thread: (usize, Levels),
    /// Latency left, seconds (it waits this before moving bytes).
    latency_left: f64,
    /// Fraction of it left.
    left: f64,
    stage: Stage,
    start: f64,
}

/// What the training thread is doing.
enum Main {
    /// At the next event of the schedule.
    Ready,
    /// Computing, with this many core-seconds of work left.
    Computing(f64),
    /// Waiting for gathers, then computing this many core-seconds.
    Waiting {
        jobs: Vec<usize>,
        then: f64,
        since: f64,
    },
    /// After the last event: waiting for the reductions.
    Draining { since: f64 },
}

/// The rank's cores, split max-min fairly among consumers of the given demands (core-seconds
/// per second; `f64::INFINITY` for a consumer that takes all it gets).
fn share(capacity: f64, demands: &[f64]) -> Vec<f64> {
    let mut alloc = vec![0.0; demands.len()];
    let mut open: Vec<usize> = (0..demands.len()).collect();
    let mut left = capacity;
    while !open.is_empty() {
        let fair = left / open.len() as f64;
        let (small, big): (Vec<usize>, Vec<usize>) =
            open.iter().partition(|&&i| demands[i] <= fair);
        if small.is_empty() {
            for i in big {
                alloc[i] = fair;
            }
            break;
        }
        for i in small {
            alloc[i] = demands[i];
            left -= demands[i];
        }
        open = big;
    }
    alloc
}

/// The fraction of its lone speed each stage gets when `asks[i][l]` is the share of level
/// `l`'s links stage `i` uses alone (0 where it does not use them): every level is split
/// max-min fairly among the stages asking for it, and a stage runs as fast as its tightest
/// level lets it.
fn grants(asks: &[Vec<f64>]) -> Vec<f64> {
    let mut granted = vec![1.0f64; asks.len()];
    let depth = asks.iter().map(Vec::len).max().unwrap_or(0);
    for l in 0..depth {
        let level: Vec<f64> = asks
            .iter()
            .map(|a| a.get(l).copied().unwrap_or(0.0))
            .collect();
        for ((g, got), ask) in granted.iter_mut().zip(share(1.0, &level)).zip(&level) {
            if *ask > 0.0 {
                *g = g.min(got / ask);
            }
        }
    }
    granted
}

/// Replays one optimizer step of `grad_accum` micro-batches of `plan` on `profile`'s machine.
pub fn simulate(plan: &Plan, grad_accum: usize, profile: &Profile) -> Timeline {
    let topology = &plan.topology;
    let depth = topology.depth();
    let mut net = Network::new(topology, profile);
    let cpu = profile.cpu.as_ref();
    // A rank's cores; without a CPU profile, compute has them to itself.
    let cores = cpu.map_or(1.0, |c| c.cores_per_rank);
    let flop_s = cores / profile.compute_rate();
    let events = plan.schedule(grad_accum);
    let mut jobs: Vec<Job> = Vec::new();
    let mut queues: HashMap<(usize, Levels), VecDeque<usize>> = HashMap::new();
    let mut busy_threads: HashMap<(usize, Levels), usize> = HashMap::new();
    let mut gathers: VecDeque<usize> = VecDeque::new();
    let mut reductions: Vec<usize> = Vec::new();
    let mut active: Vec<Transfer> = Vec::new();
    let mut link_bytes = vec![0.0; depth];
    let (mut t, mut wait, mut compute) = (0.0f64, 0.0f64, 0.0f64);
    let mut next = 0;
    let mut main = Main::Ready;
    let mut spans: Vec<Interval> = Vec::new();
    // The visit being computed: its name and start.
    let mut visit: (String, f64) = (String::new(), 0.0);

    // Core-seconds of a visit: its FLOPs, and building its units' module and gradients.
    let visit_work = |e: &Event| -> f64 {
        let f = &plan.flops;
        let params = |stage: usize| -> f64 {
            plan.units[stage]
                .needs
                .iter()
                .map(|&u| plan.units[u].numel as f64)
                .sum()
        };
        let per_param = cpu.map_or(0.0, |c| c.visit_param_s);
        match *e {
            Event::Visit(v) if !v.backward => f[v.stage] * flop_s + params(v.stage) * per_param,
            // Through a kept graph: backward only; else forward (again, or for the last
            // stage, the first time) with autodiff, then backward.
            Event::Visit(v) if plan.keeps_graph(v.stage) => {
                2.0 * f[v.stage] * flop_s + params(v.stage) * per_param
            }
            Event::Visit(v) => 3.0 * f[v.stage] * flop_s + params(v.stage) * per_param,
            Event::Whole { .. } => {
                3.0 * f.iter().sum::<f64>() * flop_s
                    + (0..plan.units.len()).map(params).sum::<f64>() * per_param
            }
            _ => 0.0,
        }
    };

    loop {
        // The training thread goes as far as it can at time `t`.
        while let Main::Ready = main {
            let Some(&event) = events.get(next) else {
                main = Main::Draining { since: t };
                break;
            };
            next += 1;
            match event {
                Event::Gather { unit, .. } | Event::Reduce { unit, .. } => {
                    let lane = usize::from(matches!(event, Event::Reduce { .. }));
                    let kind = if lane == 0 { "gather" } else { "reduce" };
                    let stages: Vec<Stage> = plan
                        .collectives(event)
                        .iter()
                        .map(|c| {
                            let cost = net.cost(c);
                            for (acc, b) in link_bytes.iter_mut().zip(&cost.link_bytes) {
                                *acc += b;
                            }
                            let cpu_s = cpu.map_or(0.0, |cpu| {
                                cost.sent_bytes
                                    .iter()
                                    .zip(&cpu.message_byte_s)
                                    .map(|(b, (_, s))| b * s)
                                    .sum::<f64>()
                                    + c.bytes as f64 * 2.0 * cpu.copy_byte_s
                                    + c.quant_elements * cpu.quant_element_s
                            });
                            Stage {
                                name: format!("{kind} {unit} {}", c.group.name(topology)),
                                group: c.group,
                                latency_s: cost.latency_s,
                                transfer_s: cost.transfer_s,
                                busy_s: cost.busy_s,
                                flows: cost.flows,
                                cpu_s,
                            }
                        })
                        .collect();
                    let id = jobs.len();
                    let done_now = stages.is_empty();
                    for stage in &stages {
                        queues.entry((lane, stage.group)).or_default().push_back(id);
                    }
                    jobs.push(Job {
                        stages,
                        done: 0,
                        finished: done_now.then_some(t),
                    });
                    if lane == 0 {
                        gathers.push_back(id);
                    } else {
                        reductions.push(id);
                    }
                }
                Event::Visit(v) => {
                    let dir = if v.backward { 'b' } else { 'f' };
                    visit.0 = format!("visit {dir}{}", v.stage);
                    let n = if v.backward && plan.keeps_graph(v.stage) {
                        0
                    } else {
                        plan.units[v.stage].needs.len()
                    };
                    let needed: Vec<usize> = (0..n).filter_map(|_| gathers.pop_front()).collect();
                    main = Main::Waiting {
                        jobs: needed,
                        then: visit_work(&event),
                        since: t,
                    };
                }
                Event::Whole { micro } => {
                    visit = (format!("whole {micro}"), t);
                    main = Main::Computing(visit_work(&event));
                }
            }
            if let Main::Waiting {
                jobs: ref need,
                then,
                since,
            } = main
                && need.iter().all(|&j| jobs[j].finished.is_some())
            {
                wait += t - since;
                visit.1 = t;
                main = Main::Computing(then);
            }
        }
        // Idle threads start the next stage in their order, once its job has reached it.
        let mut keys: Vec<(usize, Levels)> = queues.keys().copied().collect();
        keys.sort();
        for key in keys {
            if busy_threads.contains_key(&key) {
                continue;
            }
            let Some(&id) = queues[&key].front() else {
                continue;
            };
            let job = &jobs[id];
            if job.stages[job.done].group != key.1 {
                continue;
            }
            queues.get_mut(&key).expect("listed").pop_front();
            busy_threads.insert(key, id);
            let stage = job.stages[job.done].clone();
            active.push(Transfer {
                job: id,
                thread: key,
                latency_left: stage.latency_s,
                left: 1.0,
                stage,
                start: t,
            });
        }
        // Link rates: each moving stage shares every level it uses with the others using it,
        // and the flows of all of them share each link.
        let moving = |x: &Transfer| x.latency_left <= 0.0;
        let mut flows = vec![0usize; depth];
        for x in active.iter().filter(|x| moving(x)) {
            for (l, b) in x.stage.busy_s.iter().enumerate() {
                if *b > 0.0 {
                    flows[l] += x.stage.flows[l];
                }
            }
        }
        // Fraction of each moving stage done per second, as far as the links go. On every
        // level, the stages using it split its links max-min fairly: each asks for the share
        // it uses alone (its busy time there over its transfer time), scaled up where the
        // level then carries more flows than the stage alone puts on it; a stage bound on
        // another level asks for little, and the others get the rest. A stage runs at the
        // fraction of its lone speed its tightest level grants.
        let asks: Vec<Vec<f64>> = active
            .iter()
            .map(|x| {
                let st = &x.stage;
                (0..depth)
                    .map(|l| {
                        if !moving(x) || st.busy_s[l] <= 0.0 || st.transfer_s <= 0.0 {
                            return 0.0;
                        }
                        let own = profile.flow_efficiency(l, st.flows[l]);
                        let all = profile.flow_efficiency(l, flows[l]);
                        st.busy_s[l] / st.transfer_s * own / all
                    })
                    .collect()
            })
            .collect();
        let granted = grants(&asks);
        let link_rate: Vec<f64> = active
            .iter()
            .zip(&granted)
            .map(|(x, &g)| {
                if x.stage.transfer_s > 0.0 {
                    g / x.stage.transfer_s
                } else {
                    f64::INFINITY
                }
            })
            .collect();
        // CPU: the training thread (when computing) and the moving stages with CPU work.
        let mut demands: Vec<f64> = active
            .iter()
            .zip(&link_rate)
            .map(|(x, &r)| {
                if moving(x) && x.stage.cpu_s > 0.0 {
                    x.stage.cpu_s * r
                } else {
                    0.0
                }
            })
            .collect();
        let computing = matches!(main, Main::Computing(_));
        demands.push(if computing { f64::INFINITY } else { 0.0 });
        let alloc = share(cores, &demands);
        let rates: Vec<f64> = active
            .iter()
            .enumerate()
            .map(|(i, x)| {
                if x.stage.cpu_s > 0.0 {
                    link_rate[i].min(alloc[i] / x.stage.cpu_s)
                } else {
                    link_rate[i]
                }
            })
            .collect();
        let main_rate = alloc[active.len()];
        // The next thing to happen.
        let mut dt = f64::INFINITY;
        if let Main::Computing(work) = main {
            dt = dt.min(if work <= 0.0 { 0.0 } else { work / main_rate });
        }
        for (x, &r) in active.iter().zip(&rates) {
            dt = dt.min(if moving(x) {
                x.left / r
            } else {
                x.latency_left
            });
        }
        if let Main::Draining { since } = main
            && active.is_empty()
            && reductions.iter().all(|&j| jobs[j].finished.is_some())
        {
            wait += t - since;
            break;
        }
        if !dt.is_finite() {
            // Nothing can move: the schedule waits on a job no thread will start.
            break;
        }
        let dt = dt.max(0.0);
        t += dt;
        let mut finished = Vec::new();
        for (i, x) in active.iter_mut().enumerate() {
            if x.latency_left > 0.0 {
                x.latency_left -= dt;
                if x.latency_left <= 1e-12 {
                    x.latency_left = 0.0;
                    if !rates[i].is_finite() || x.stage.transfer_s <= 0.0 && x.stage.cpu_s <= 0.0 {
                        finished.push(i);
                    }
                }
            } else {
                x.left -= dt * rates[i];
                if x.left <= 1e-9 {
                    finished.push(i);
                }
            }
        }
        for i in finished.into_iter().rev() {
            let x = active.swap_remove(i);
            spans.push(Interval {
                what: x.stage.name.clone(),
                start: x.start,
                end: t,
            });
            busy_threads.remove(&x.thread);
            let job = &mut jobs[x.job];
            job.done += 1;
            if job.done == job.stages.len() {
                job.finished = Some(t);
            }
        }
        if let Main::Computing(work) = main {
            let left = work - dt * main_rate;
            compute += dt;
            main = if left <= 1e-12 {
                spans.push(Interval {
                    what: std::mem::take(&mut visit.0),
                    start: visit.1,
                    end: t,
                });
                Main::Ready
            } else {
                Main::Computing(left)
            };
        }
        if let Main::Waiting {
            jobs: ref need,
            then,
            since,
        } = main
            && need.iter().all(|&j| jobs[j].finished.is_some())
        {
            wait += t - since;
            visit.1 = t;
            main = Main::Computing(then);
        }
    }
    // The closing collectives on the training thread, then the optimizer step.
    let closing: f64 = plan
        .closing_collectives()
        .iter()
        .map(|c| {
            let cost = net.cost(c);
            for (acc, b) in link_bytes.iter_mut().zip(&cost.link_bytes) {
                *acc += b;
            }
            cost.latency_s + cost.transfer_s
        })
        .sum();
    let optimizer_s = cpu.map_or(0.0, |c| {
        let elements: usize = (0..plan.units.len())
            .map(|u| plan.shard_len(u, plan.config.optimizer()))
            .sum();
        elements as f64 * c.optimizer_element_s / cores
    });
    Timeline {
        step_s: t + closing + optimizer_s,
        comm_wait_s: wait + closing,
        compute_s: compute + optimizer_s,
        link_bytes,
        spans,
    }
}

#[cfg(test)]
mod tests {
    use super::{grants, share};

    #[test]
    fn a_stage_bound_elsewhere_leaves_the_shared_link_to_the_others() {
        // Two stages that each fill the GPU links alone run at half speed together.
        assert_eq!(grants(&[vec![0.0, 1.0], vec![0.0, 1.0]]), vec![0.5, 0.5]);
        // A gather bound on the uplinks uses a tenth of the GPU links: it keeps its speed and
        // the ring beside it gets the other nine tenths.
        let g = grants(&[vec![0.0, 1.0, 0.0], vec![0.0, 0.1, 1.0]]);
        assert!((g[0] - 0.9).abs() < 1e-12 && g[1] == 1.0, "{g:?}");
        // Two such gathers halve each other on the uplinks.
        let g = grants(&[
            vec![0.0, 1.0, 0.0],
            vec![0.0, 0.1, 1.0],
            vec![0.0, 0.1, 1.0],
        ]);
        assert!(
            (g[0] - 0.8).abs() < 1e-12 && g[1] == 0.5 && g[2] == 0.5,
            "{g:?}"
        );
    }

    #[test]
    fn cores_go_to_the_hungry_after_the_modest_are_served() {
        assert_eq!(share(1.0, &[0.1, f64::INFINITY]), vec![0.1, 0.9]);
        assert_eq!(share(1.0, &[f64::INFINITY, f64::INFINITY]), vec![0.5, 0.5]);
        assert_eq!(share(1.0, &[0.8, 0.8]), vec![0.5, 0.5]);
        assert_eq!(share(1.0, &[0.0]), vec![0.0]);
    }
}
