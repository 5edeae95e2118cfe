//! Suite `cdb`: CB against depth batching (no-refill, refill; min coda sizes, coda reserves,
//! overlap) on one workload per width, with the FLOP and prefill-adjusted bounds.

use crate::{Args, BenchModel};
use ponder::bench::{offline, stage_device, workload, Job, Lengths, Window};
use ponder::EngineBuilder;

/// Where a run's exit depths come from: a seeded distribution with a given mean, or a recorded
/// trace (`--depth-traces`) with the overlap setting it is compared under.
pub(crate) struct DepthSource {
    label: Option<String>,
    trace: ponder::looped::gate::DepthTrace,
    min_depth: usize,
    overlap: Option<bool>,
}

/// `--depth-traces LABEL=FILE[:on|off],...` (recorded per-token depths, e.g. from the
/// `quality_gates` example, replayed as a stream), else one seeded source per `--mean-depths`.
fn depth_sources(args: &Args, max_steps: usize) -> Result<Vec<DepthSource>, Box<dyn std::error::Error>> {
    use ponder::looped::gate::DepthTrace;
    if args.depth_traces.is_empty() {
        return args
            .mean_depths
            .iter()
            .map(|&m| Ok(DepthSource { label: None, trace: DepthTrace::with_mean(m, args.min_depth, max_steps, 5)?, min_depth: args.min_depth, overlap: None }))
            .collect();
    }
    args.depth_traces
        .iter()
        .map(|spec| {
            let (label, rest) = spec.split_once('=').ok_or_else(|| format!("--depth-traces entry {spec} is not LABEL=FILE[:on|off]"))?;
            let (file, overlap) = match rest.rsplit_once(':') {
                Some((f, o)) if o == "on" || o == "off" => (f, Some(o == "on")),
                _ => (rest, None),
            };
            // Recorded depths are replayed as chosen (a depth-1 exit included).
            let trace = DepthTrace::stream_from_json_file(std::path::Path::new(file), 5)?;
            Ok(DepthSource { label: Some(label.to_string()), trace, min_depth: 1, overlap })
        })
        .collect()
}

pub(crate) fn cdb_suite(args: &Args, model: &BenchModel, roof: crate::Roof) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    use ponder::looped::gate::Replay;
    use ponder::SchedulerKind;
    let spec = model.spec().clone();
    let slots = args.layout.build().num_slots(spec.max_steps);
    let bytes_per_pos = ponder::kv::KvStore::bytes_per_block(spec.num_kv_layers, 1, spec.num_kv_heads, spec.head_dim, spec.dtype) * slots;
    let mut results = Vec::new();
    let sources = depth_sources(args, spec.max_steps)?;
    println!("{:>5} {:>6} {:>20} {:>10} {:>8} {:>7} {:>7} {:>8} {:>7}", "width", "d̄", "mode", "tok/s", "vs CB", "bound", "of bnd", "idle", "d̄ real");
    for &w in &args.widths {
        let jobs = workload(args.requests_per_width * w, spec.vocab_size, spec.max_context, 42 + w as u64, args.lengths);
        let max_need = jobs.iter().map(|j| j.prompt.len() + j.new_tokens).max().unwrap_or(1) + 16;
        // Min coda batch sizes to compare: numbers, "quarter" (W/4), "half" (W/2) or "full" (W); reserves:
        // numbers or "parked" (min coda − 1).
        let coda_size = |m: &str| match m {
            "quarter" => Ok((w / 4).max(1)),
            "half" => Ok((w / 2).max(1)),
            "full" => Ok(w),
            n => n.parse::<usize>(),
        };
        let reserve_size = |r: &str, m: usize| if r == "parked" { Ok(m.saturating_sub(1)) } else { r.parse::<usize>() };
        // (min coda, reserve) pairs of refill: `--coda-pairs`, else every min coda × reserve.
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        if args.coda_pairs.is_empty() {
            for m in &args.min_coda {
                let m = coda_size(m)?;
                for r in &args.coda_reserve {
                    pairs.push((m, reserve_size(r, m)?));
                }
            }
        } else {
            for pair in &args.coda_pairs {
                let (m, r) = pair.split_once(':').ok_or_else(|| format!("--coda-pairs entry {pair} is not MIN_CODA:RESERVE"))?;
                let m = coda_size(m)?;
                pairs.push((m, reserve_size(r, m)?));
            }
        }
        let mut seen = std::collections::HashSet::new();
        pairs.retain(|p| seen.insert(*p));
        let mut seen = std::collections::HashSet::new();
        let min_codas: Vec<usize> = pairs.iter().map(|p| p.0).filter(|m| seen.insert(*m)).collect();
        // Room for the most resident requests any variant admits (a coda reserve adds some).
        let most_resident = w + pairs.iter().map(|p| p.1).max().unwrap_or(0);
        let kv_tokens = ((args.kv_gb * 1e9) as usize / bytes_per_pos).min(most_resident * max_need) * slots;
        let build = |sched: SchedulerKind, src: &DepthSource, min_coda: usize, reserve: usize| -> ponder::Result<ponder::Engine> {
            let b = EngineBuilder::from_model(model.boxed(), None, vec![])
                .kernels(args.kernels)
                .looped(|o| o.kv_layout(args.layout).scheduler(sched))
                .max_num_seqs(w)
                .max_num_batched_tokens(8192)
                .kv_capacity_tokens(kv_tokens)
                .looped(|o| o.time_device(args.time_device));
            match sched {
                SchedulerKind::Continuous => b.build(),
                _ => {
                    let gate = Replay::new(src.trace.clone(), src.min_depth, spec.max_steps)?;
                    b.looped(|o| o.min_coda_batch_size(min_coda).coda_reserve(reserve).exit_gate(gate)).build()
                }
            }
        };
        let warm =
            workload(w.min(32), spec.vocab_size, spec.max_context, 1, Lengths::default()).into_iter().map(|j| Job { new_tokens: 8, ..j }).collect::<Vec<_>>();
        let mut cb_tps = None;
        // CB's device seconds in (prefill, decode), for the prefill-adjusted bound.
        let mut cb_device: Option<(f64, f64)> = None;
        for (di, src) in sources.iter().enumerate() {
            let mean = src.trace.expected_mean();
            for mode in &args.modes {
                let sched: SchedulerKind = mode.parse()?;
                // No-refill holds every resident request in its wave: no reserve.
                let sched_pairs: Vec<(usize, usize)> =
                    if sched == (SchedulerKind::Depth { refill: true }) { pairs.clone() } else { min_codas.iter().map(|&m| (m, 0)).collect() };
                let variants: Vec<(usize, usize, bool)> = if sched == SchedulerKind::Continuous {
                    vec![(min_codas[0], 0, false)]
                } else {
                    let overlaps = src.overlap.map_or_else(|| args.overlap.clone(), |o| vec![o]);
                    sched_pairs.iter().flat_map(|&(m, r)| overlaps.iter().map(move |&o| (m, r, o))).collect()
                };
                for (min_coda, reserve, overlap) in variants {
                    if sched == SchedulerKind::Continuous && di > 0 {
                        // CB runs full depth whatever the exit distribution: measured once per width.
                        let prev = results.iter().rev().find(|r: &&serde_json::Value| r["mode"] == "cb" && r["width"] == w).cloned();
                        if let Some(mut r) = prev {
                            r["mean_depth"] = mean.into();
                            r["target_mean_depth"] = mean.into();
                            r["flop_bound"] = spec.flop_bound(mean).into();
                            results.push(r);
                        }
                        continue;
                    }
                    // Peak memory of this mode: the previous engine's memory is freed by now.
                    model.device().synchronize()?;
                    // Unmeasured rather than a failed run if the driver refuses the memory counters.
                    let tracked = ponder::bench::device_memory::reset_peak(model.device()).inspect_err(|e| eprintln!("peak memory not measured: {e}")).is_ok();
                    let mut engine = build(sched, src, min_coda, reserve)?;
                    engine.set_overlap(overlap)?;
                    offline(&mut engine, &warm, Window { open_after: w, completions: None, drain: true })?;
                    // Repeats on the same engine (graphs captured by then); the median run by
                    // window tokens/s is reported, every run's figure is kept.
                    let n = if args.repeats_set { args.repeats.max(1) } else { 1 };
                    // The window opens once as many requests have finished as can be resident at once.
                    let window = Window { open_after: w + reserve, completions: args.window_completions.map(|k| k.of(w)), drain: args.drain };
                    let mut runs = (0..n).map(|_| offline(&mut engine, &jobs, window)).collect::<Result<Vec<_>, _>>()?;
                    runs.sort_by(|a, b| a.window_tokens_per_s.total_cmp(&b.window_tokens_per_s));
                    let all_tps: Vec<f64> = runs.iter().map(|r| r.window_tokens_per_s).collect();
                    let st = runs.swap_remove(n / 2);
                    let peak = if tracked { ponder::bench::device_memory::peak(model.device()).ok().flatten() } else { None };
                    let realised = if sched == SchedulerKind::Continuous { spec.max_steps as f64 } else { st.mean_depth };
                    let bound = spec.flop_bound(realised);
                    if sched == SchedulerKind::Continuous {
                        cb_tps = Some(st.window_tokens_per_s);
                        cb_device = stage_device(&st.stages, "prefill").zip(stage_device(&st.stages, "decode"));
                    }
                    let speedup = cb_tps.map(|c| st.window_tokens_per_s / c);
                    // On the CPU (`--tiny`) the host is the device: no idle share to speak of.
                    let idle = (!args.tiny).then_some(st.idle);
                    // The paper's realistic ceiling: CB's device time with its decode divided by
                    // the FLOP bound and its prefill (full depth in every mode) unchanged.
                    let adjusted = cb_device.filter(|_| sched != SchedulerKind::Continuous).map(|(p, d)| (p + d) / (p + d / bound));
                    let mut label = match (&src.label, sched) {
                        (Some(l), s) if s != SchedulerKind::Continuous => format!("{l}/{mode}"),
                        _ => mode.clone(),
                    };
                    if min_codas.len() > 1 && sched != SchedulerKind::Continuous {
                        label += &format!("/coda{min_coda}");
                    }
                    if reserve > 0 {
                        label += &format!("/res{reserve}");
                    }
                    if overlap {
                        label += "/overlap";
                    }
                    println!(
                        "{w:>5} {mean:>6.2} {label:>20} {:>10.0} {:>8} {bound:>7.3} {:>7} {:>8}{} {realised:>7.2}",
                        st.window_tokens_per_s,
                        speedup.map_or("-".into(), |s| format!("{s:.3}x")),
                        speedup.map_or("-".into(), |s| format!("{:.1}%", 100.0 * s / bound)),
                        idle.map_or("-".into(), |i| format!("{:.1}%", 100.0 * i)),
                        if st.idle_exact { "=" } else { " " }
                    );
                    if let Some(p) = peak {
                        println!("{:>14} peak device memory {p}", "");
                    }
                    if st.window_completions.is_none() {
                        println!("{:>14} no steady-state window (too short): whole-run figures", "");
                    }
                    if let (Some(a), Some(s)) = (adjusted, speedup) {
                        println!("{:>14} prefill-adjusted bound {a:.3}x: {:.1}% of it", "", 100.0 * s / a);
                    }
                    let mut stages = st.stages.clone();
                    let roof_parts = roof.annotate(&mut stages);
                    println!("{:>14} of the roofline (bytes read ÷ bandwidth vs FLOPs ÷ peak): {}", "", roof_parts.join(" · "));
                    if args.time_device {
                        let parts: Vec<String> = st
                            .stages
                            .as_object()
                            .into_iter()
                            .flatten()
                            .filter_map(|(k, v)| {
                                let f = v["device_forward_s"].as_f64().unwrap_or(0.0);
                                v["device_s"].as_f64().map(|d| format!("{k} {d:.2} s (forward {f:.2}) / {} launches", v["launches"]))
                            })
                            .collect();
                        if !parts.is_empty() {
                            println!("{:>14} device time: {}", "", parts.join(" · "));
                        }
                    }
                    results.push(serde_json::json!({
                        "mode": mode, "depth_source": src.label, "width": w, "min_coda_batch_size": min_coda, "coda_reserve": reserve, "overlap": overlap,
                        "mean_depth": if sched == SchedulerKind::Continuous { mean } else { realised },
                        "target_mean_depth": mean, "tokens_per_s": st.window_tokens_per_s, "tokens_per_s_whole_run": st.whole_tokens_per_s,
                        "speedup_vs_cb": speedup, "flop_bound": spec.flop_bound(if sched == SchedulerKind::Continuous { mean } else { realised }),
                        "fraction_of_bound": speedup.map(|s| s / spec.flop_bound(realised)), "gpu_idle": idle, "gpu_idle_exact": st.idle_exact,
                        "requests": jobs.len(), "window_open_after": window.open_after, "window_completions": st.window_completions, "stages": stages, "repeats_tokens_per_s": all_tps,
                        "prefill_adjusted_bound": adjusted, "fraction_of_prefill_adjusted_bound": adjusted.zip(speedup).map(|(a, s)| s / a),
                    }));
                    let row = results.last_mut().and_then(|r| r.as_object_mut()).expect("just pushed");
                    row.extend(ponder::bench::device_memory::PeakMemory::json_fields(peak).map(|(k, v)| (k.to_string(), v.into())));
                }
            }
        }
    }
    Ok(results)
}
