//! `--parity`: the device model against the f32 CPU reference on the same random weights.

use crate::ModelRecipe;
use candle_core::{DType, Device, Tensor};
use ponder::bench::random_ids;
use ponder::engine::internals::LoopedRunner;
use ponder::kv::KvManager;
use ponder::loader::Weights;
use ponder::looped::layout::KvLayout;
use ponder::looped::{LoopedLaunch, LoopedRow, Stage};
use ponder::testing::random_tensors;
use ponder::{KvLayoutKind, RequestId};
use std::time::Instant;

/// Next-token logits of the device model (in `dtype`, its linear layers stored as
/// `quantization` says) vs the f32 CPU reference on the same weights: a prefill of 4 ragged
/// prompts, then one decode step. With FP8 this is the logits' error FP8 weights cost.
pub(crate) fn parity(
    recipe: &ModelRecipe,
    device: &Device,
    dtype: DType,
    quantization: ponder::quant::Quantization,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let t = Instant::now();
    let master = random_tensors(&recipe.manifest, 11, DType::F32, device)?;
    let cpu: std::collections::HashMap<_, _> = master.iter().map(|(k, v)| Ok((k.clone(), v.to_device(&Device::Cpu)?))).collect::<candle_core::Result<_>>()?;
    let dev_model = (recipe.load)(&Weights::from_map(master, dtype, device).with_quantization(quantization))?;
    let cpu_model = (recipe.load)(&Weights::from_map(cpu, DType::F32, &Device::Cpu))?;
    let steps = cpu_model.spec().max_steps;
    let block = 16;
    let lens = [5usize, 17, 33, 9];
    let layout: Box<dyn KvLayout> = KvLayoutKind::DepthIndexed.build();
    let num_blocks = 4 * steps * 8;
    let mut kv = KvManager::new(num_blocks, block, layout.num_slots(steps));
    let dev_runner = LoopedRunner::new(dev_model.boxed(), num_blocks, block, 0)?;
    let cpu_runner = LoopedRunner::new(cpu_model.boxed(), num_blocks, block, 0)?;
    let step_slots: Vec<usize> = (0..steps).collect();
    let prompts: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| random_ids(n, cpu_model.spec().vocab_size, 50 + i as u64)).collect();
    let rows = |toks: &[Vec<u32>], start: &[usize], kv: &mut KvManager| -> Vec<LoopedRow> {
        toks.iter()
            .zip(start)
            .enumerate()
            .map(|(i, (t, &s))| {
                assert!(kv.reserve(RequestId(i as u64), s + t.len()));
                LoopedRow::full_depth(RequestId(i as u64), t.clone(), s, kv.tables(RequestId(i as u64)).unwrap().to_vec())
            })
            .collect()
    };
    let prefill =
        LoopedLaunch { stage: Stage::Prefill, step_slots: step_slots.clone(), rows: rows(&prompts, &[0; 4], &mut kv), kv_copies: vec![], reenter: false };
    let mut report = Vec::new();
    let (a, b) = (dev_runner.forward(&prefill)?, cpu_runner.forward(&prefill)?);
    report.push(compare("prefill", &a, &b)?);
    let next: Vec<Vec<u32>> = b.logits.unwrap().argmax(1)?.to_vec1::<u32>()?.into_iter().map(|t| vec![t]).collect();
    let decode = LoopedLaunch { stage: Stage::FullDepthDecode, step_slots, rows: rows(&next, &lens, &mut kv), kv_copies: vec![], reenter: false };
    let (a, b) = (dev_runner.forward(&decode)?, cpu_runner.forward(&decode)?);
    report.push(compare("decode", &a, &b)?);
    println!("parity done in {:.1}s", t.elapsed().as_secs_f64());
    Ok(serde_json::Value::Array(report))
}

fn compare(
    name: &str,
    dev: &ponder::engine::internals::Forward,
    cpu: &ponder::engine::internals::Forward,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let rel = |a: &Tensor, b: &Tensor| -> candle_core::Result<f64> {
        let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
        let b = b.to_dtype(DType::F64)?;
        let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
        Ok(num / b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt())
    };
    let (la, lb) = (dev.logits.as_ref().unwrap(), cpu.logits.as_ref().unwrap());
    let logits_rel = rel(la, lb)?;
    let gate_rel = match (&dev.gate_logits, &cpu.gate_logits) {
        (Some(a), Some(b)) => rel(a, b)?,
        _ => f64::NAN, // the model has no exit gate (Huginn)
    };
    let am_a = la.to_device(&Device::Cpu)?.argmax(1)?.to_vec1::<u32>()?;
    let am_b = lb.argmax(1)?.to_vec1::<u32>()?;
    let agree = am_a.iter().zip(&am_b).filter(|(x, y)| x == y).count();
    println!("parity {name}: logits rel err {logits_rel:.2e}, gate-logit rel err {gate_rel:.2e}, argmax agree {agree}/{}", am_b.len());
    Ok(serde_json::json!({ "stage": name, "logits_rel_err": logits_rel, "gate_logits_rel_err": gate_rel, "argmax_agree": agree, "rows": am_b.len() }))
}
