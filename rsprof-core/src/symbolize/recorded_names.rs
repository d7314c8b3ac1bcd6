//! Kernel names kept for a replay: with `--save-raw`, what the kernel namer answered goes into
//! the raw stream ([`TeeNames`]); a replay names kernel addresses from those answers alone
//! ([`RecordedNames`]), since kallsyms there is hidden from an unprivileged user or belongs to
//! another boot.

use std::collections::HashMap;

use anyhow::Result;

use crate::{
    collect::{
        facts::SharedRaw,
        raw::{Entry, KernelName},
    },
    symbolize::{KernelNames, KernelSymbol},
};

/// A namer whose every answer is also written to the raw stream.
pub struct TeeNames {
    pub inner: Box<dyn KernelNames>,
    pub raw: SharedRaw,
}

impl KernelNames for TeeNames {
    fn name(&mut self, addrs: &[u64]) -> Result<Vec<Option<KernelSymbol>>> {
        let names = self.inner.name(addrs)?;
        let batch = addrs
            .iter()
            .zip(&names)
            .map(|(&addr, n)| KernelName {
                addr,
                name: n.as_ref().map(|s| (s.name.clone(), s.offset, s.size)),
            })
            .collect();
        self.raw.lock().unwrap_or_else(|e| e.into_inner()).write(&Entry::KernelSymbols(batch));
        Ok(names)
    }
}

/// The names a raw stream holds; an address it does not hold stays unnamed.
#[derive(Debug, Default)]
pub struct RecordedNames {
    names: HashMap<u64, Option<KernelSymbol>>,
}

impl RecordedNames {
    pub fn add(&mut self, batch: Vec<KernelName>) {
        for k in batch {
            let sym = k.name.map(|(name, offset, size)| KernelSymbol { name, offset, size });
            self.names.insert(k.addr, sym);
        }
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

impl KernelNames for RecordedNames {
    fn name(&mut self, addrs: &[u64]) -> Result<Vec<Option<KernelSymbol>>> {
        Ok(addrs.iter().map(|a| self.names.get(a).cloned().flatten()).collect())
    }

    fn only_source(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_names_answer_only_what_was_recorded() {
        let mut r = RecordedNames::default();
        r.add(vec![
            KernelName { addr: 0x10, name: Some(("do_work".into(), 4, 32)) },
            KernelName { addr: 0x20, name: None },
        ]);
        let got = r.name(&[0x10, 0x20, 0x30]).unwrap();
        assert_eq!(got[0].as_ref().map(|s| (s.name.as_str(), s.offset)), Some(("do_work", 4)));
        assert_eq!(got[1..], [None, None]);
        assert!(r.only_source());
    }
}
