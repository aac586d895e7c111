"""Synthetic patient memory for read-path benchmarks: coded-reasoner-shaped states at any scale.

Vocabulary: ~300 clinical concepts (labs and vitals with units and value distributions, medications with
doses, conditions, procedures), each with a synthetic code in its real code system (LOINC, RxNorm, SNOMED CT)
and the coded reasoner's concept-level embedding text (``"observation: Hemoglobin"``), so one vector per
concept serves every memory of it, exactly as on the write path.

A patient is a set of *chains*: the successive facts of one coded concept (repeated lab values, re-dosed
orders, restated diagnoses). Within a chain every fact but the newest is HISTORY (``superseded``, successor =
the next fact); a medication chain may end stopped/completed and a condition chain resolved, in which case
its last fact is HISTORY too (the terminal fact's own reason, as the coded reasoner places it). The number of
chains is chosen so that about ``history_fraction`` of the memories end in HISTORY; when a concept is drawn
for a second chain of the same patient it gets its own code (like MIMIC's several item ids per lab name:
blood gas, chemistry, point of care), so it is a separate identity with its own ACTIVE head. Chain lengths are
skewed by category (vitals and labs repeat most, procedures least) and concept popularity is Zipf-like with
per-patient variation. Relations: restatement edges along each chain, treatment_for from medications and
monitoring_for from some labs to the patient's conditions.

Everything is deterministic in (seed, patient index).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from schemas import AtomicMemory, Category, CodeSystem, Coding, Reason, Relation, RelationType, Store
from stam.backends.base import VectorRow
from stam.ids import memory_id
from stam.patient_state import PatientState

# name, unit, mean, sd, decimals
LABS: tuple[tuple[str, str, float, float, int], ...] = (
    ("Hemoglobin", "g/dL", 12.5, 1.8, 1), ("Hematocrit", "%", 38, 5, 1),
    ("White blood cell count", "10*3/uL", 8, 3, 1), ("Platelet count", "10*3/uL", 250, 70, 0),
    ("Sodium", "mmol/L", 139, 3.5, 0), ("Potassium", "mmol/L", 4.2, 0.5, 1), ("Chloride", "mmol/L", 102, 4, 0),
    ("Bicarbonate", "mmol/L", 25, 3, 0), ("Urea nitrogen", "mg/dL", 18, 8, 0), ("Creatinine", "mg/dL", 1.0, 0.4, 2),
    ("Glucose", "mg/dL", 115, 30, 0), ("Calcium", "mg/dL", 9.2, 0.5, 1), ("Anion gap", "mmol/L", 12, 3, 0),
    ("Magnesium", "mg/dL", 2.0, 0.25, 1), ("Phosphate", "mg/dL", 3.6, 0.7, 1),
    ("Red blood cell count", "10*6/uL", 4.5, 0.6, 2), ("Mean corpuscular volume", "fL", 90, 6, 1),
    ("Mean corpuscular hemoglobin", "pg", 30, 2, 1), ("Mean corpuscular hemoglobin concentration", "g/dL", 33.5, 1.2, 1),
    ("Red cell distribution width", "%", 14, 1.5, 1), ("Neutrophils", "%", 62, 10, 1), ("Lymphocytes", "%", 27, 8, 1),
    ("Monocytes", "%", 7, 2, 1), ("Eosinophils", "%", 2.5, 1.5, 1), ("Basophils", "%", 0.6, 0.3, 1),
    ("INR", "{INR}", 1.2, 0.3, 1), ("Prothrombin time", "s", 13, 2, 1), ("Partial thromboplastin time", "s", 32, 5, 1),
    ("Albumin", "g/dL", 3.8, 0.5, 1), ("Total protein", "g/dL", 6.8, 0.6, 1),
    ("Alanine aminotransferase", "U/L", 30, 15, 0), ("Aspartate aminotransferase", "U/L", 32, 15, 0),
    ("Alkaline phosphatase", "U/L", 90, 30, 0), ("Total bilirubin", "mg/dL", 0.8, 0.4, 1),
    ("Direct bilirubin", "mg/dL", 0.2, 0.1, 1), ("Lactate", "mmol/L", 1.6, 0.7, 1),
    ("pH of arterial blood", "[pH]", 7.39, 0.04, 2),
    ("pCO2 of arterial blood", "mm[Hg]", 41, 6, 0), ("pO2 of arterial blood", "mm[Hg]", 90, 20, 0),
    ("Base excess", "mmol/L", 0, 3, 0), ("Oxygen saturation in arterial blood", "%", 96, 2.5, 0),
    ("Troponin T", "ng/mL", 0.02, 0.02, 3), ("Troponin I", "ng/mL", 0.03, 0.03, 3), ("NT-proBNP", "pg/mL", 600, 500, 0),
    ("Lactate dehydrogenase", "U/L", 220, 60, 0), ("Creatine kinase", "U/L", 150, 80, 0),
    ("Fibrinogen", "mg/dL", 320, 80, 0), ("D-dimer", "ug/mL FEU", 0.6, 0.5, 2), ("C-reactive protein", "mg/L", 12, 15, 1),
    ("Erythrocyte sedimentation rate", "mm/h", 20, 12, 0), ("Procalcitonin", "ng/mL", 0.2, 0.3, 2),
    ("Hemoglobin A1c", "%", 6.4, 1.1, 1), ("Total cholesterol", "mg/dL", 190, 35, 0),
    ("LDL cholesterol", "mg/dL", 110, 30, 0),
    ("HDL cholesterol", "mg/dL", 50, 12, 0), ("Triglycerides", "mg/dL", 150, 60, 0),
    ("Thyroid stimulating hormone", "mIU/L", 2, 1.2, 2), ("Free thyroxine", "ng/dL", 1.2, 0.25, 2),
    ("Ferritin", "ng/mL", 150, 120, 0), ("Iron", "ug/dL", 80, 30, 0), ("Transferrin saturation", "%", 25, 10, 0),
    ("Vitamin B12", "pg/mL", 450, 150, 0), ("Folate", "ng/mL", 12, 5, 1), ("25-hydroxyvitamin D", "ng/mL", 28, 10, 0),
    ("Uric acid", "mg/dL", 5.8, 1.5, 1), ("Lipase", "U/L", 40, 25, 0), ("Amylase", "U/L", 60, 25, 0),
    ("Ammonia", "umol/L", 30, 15, 0), ("Cortisol", "ug/dL", 12, 5, 1), ("Prostate specific antigen", "ng/mL", 1.5, 1.5, 2),
    ("Urine protein", "mg/dL", 15, 20, 0), ("Urine specific gravity", "{ratio}", 1.015, 0.007, 3),
    ("Urine albumin/creatinine ratio", "mg/g", 30, 60, 0),
    ("Estimated glomerular filtration rate", "mL/min/1.73m2", 75, 25, 0),
    ("Digoxin level", "ng/mL", 1.0, 0.4, 1), ("Vancomycin trough", "ug/mL", 15, 5, 1),
    ("Tacrolimus level", "ng/mL", 8, 3, 1),
    ("Lithium level", "mmol/L", 0.8, 0.3, 2),
)
VITALS: tuple[tuple[str, str, float, float, int], ...] = (
    ("Body weight", "kg", 80, 18, 1), ("Body height", "cm", 170, 10, 1), ("Body mass index", "kg/m2", 28, 5, 1),
    ("Systolic blood pressure", "mm[Hg]", 128, 18, 0), ("Diastolic blood pressure", "mm[Hg]", 78, 10, 0),
    ("Heart rate", "/min", 78, 14, 0), ("Respiratory rate", "/min", 17, 3, 0), ("Body temperature", "Cel", 36.9, 0.5, 1),
    ("Oxygen saturation by pulse oximetry", "%", 96, 2, 0), ("Pain severity score", "{score}", 3, 2.5, 0),
    ("Glasgow coma scale", "{score}", 14, 1.5, 0),
)
# name, unit, doses
MEDS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("Metformin", "mg", (500, 850, 1000)), ("Lisinopril", "mg", (5, 10, 20, 40)), ("Amlodipine", "mg", (2.5, 5, 10)),
    ("Atorvastatin", "mg", (10, 20, 40, 80)), ("Simvastatin", "mg", (10, 20, 40)), ("Rosuvastatin", "mg", (5, 10, 20)),
    ("Metoprolol succinate", "mg", (25, 50, 100)), ("Metoprolol tartrate", "mg", (12.5, 25, 50)),
    ("Carvedilol", "mg", (3.125, 6.25, 12.5, 25)), ("Losartan", "mg", (25, 50, 100)), ("Valsartan", "mg", (80, 160, 320)),
    ("Hydrochlorothiazide", "mg", (12.5, 25)), ("Furosemide", "mg", (20, 40, 80)), ("Torsemide", "mg", (10, 20)),
    ("Spironolactone", "mg", (12.5, 25, 50)), ("Warfarin", "mg", (2, 3, 5)), ("Apixaban", "mg", (2.5, 5)),
    ("Rivaroxaban", "mg", (10, 15, 20)), ("Heparin", "units", (5000,)), ("Enoxaparin", "mg", (40, 80)),
    ("Aspirin", "mg", (81, 325)), ("Clopidogrel", "mg", (75,)), ("Insulin glargine", "units", (10, 20, 30)),
    ("Insulin lispro", "units", (4, 6, 8)), ("Glipizide", "mg", (5, 10)), ("Sitagliptin", "mg", (50, 100)),
    ("Empagliflozin", "mg", (10, 25)), ("Levothyroxine", "mcg", (25, 50, 75, 100)), ("Omeprazole", "mg", (20, 40)),
    ("Pantoprazole", "mg", (20, 40)), ("Famotidine", "mg", (20,)), ("Ondansetron", "mg", (4, 8)),
    ("Acetaminophen", "mg", (500, 650, 1000)), ("Ibuprofen", "mg", (400, 600)), ("Oxycodone", "mg", (5, 10)),
    ("Hydromorphone", "mg", (0.5, 1, 2)), ("Morphine", "mg", (2, 4)), ("Gabapentin", "mg", (100, 300, 600)),
    ("Pregabalin", "mg", (75, 150)), ("Sertraline", "mg", (50, 100)), ("Escitalopram", "mg", (10, 20)),
    ("Fluoxetine", "mg", (20, 40)), ("Trazodone", "mg", (50, 100)), ("Quetiapine", "mg", (25, 50, 100)),
    ("Haloperidol", "mg", (1, 2, 5)), ("Lorazepam", "mg", (0.5, 1)), ("Alprazolam", "mg", (0.25, 0.5)),
    ("Zolpidem", "mg", (5, 10)), ("Prednisone", "mg", (5, 10, 20, 40)), ("Methylprednisolone", "mg", (40, 125)),
    ("Albuterol inhaler", "mcg", (90, 180)), ("Fluticasone-salmeterol inhaler", "mcg", (250, 500)),
    ("Tiotropium", "mcg", (18,)), ("Montelukast", "mg", (10,)), ("Amoxicillin", "mg", (500, 875)),
    ("Amoxicillin-clavulanate", "mg", (875,)), ("Azithromycin", "mg", (250, 500)), ("Ceftriaxone", "g", (1, 2)),
    ("Cefepime", "g", (1, 2)), ("Piperacillin-tazobactam", "g", (3.375, 4.5)), ("Vancomycin", "g", (1, 1.25, 1.5)),
    ("Levofloxacin", "mg", (500, 750)), ("Ciprofloxacin", "mg", (250, 500)), ("Doxycycline", "mg", (100,)),
    ("Trimethoprim-sulfamethoxazole", "mg", (800,)), ("Nitrofurantoin", "mg", (100,)), ("Metronidazole", "mg", (500,)),
    ("Allopurinol", "mg", (100, 300)), ("Tamsulosin", "mg", (0.4,)), ("Finasteride", "mg", (5,)),
    ("Donepezil", "mg", (5, 10)), ("Levetiracetam", "mg", (500, 750, 1000)), ("Phenytoin", "mg", (100,)),
    ("Digoxin", "mg", (0.125, 0.25)), ("Amiodarone", "mg", (200, 400)), ("Diltiazem", "mg", (120, 180, 240)),
    ("Potassium chloride", "mEq", (10, 20, 40)), ("Magnesium oxide", "mg", (400,)), ("Ferrous sulfate", "mg", (325,)),
    ("Folic acid", "mg", (1,)), ("Cholecalciferol", "units", (1000, 2000)), ("Docusate", "mg", (100,)),
    ("Senna", "mg", (8.6, 17.2)), ("Polyethylene glycol", "g", (17,)),
)
FREQUENCIES = ("once daily", "twice daily", "every 8 hours", "at bedtime", "as needed")
CONDITIONS: tuple[str, ...] = (
    "Essential hypertension", "Type 2 diabetes mellitus", "Hyperlipidemia", "Coronary artery disease",
    "Congestive heart failure", "Atrial fibrillation", "Chronic kidney disease stage 3", "Acute kidney injury",
    "Chronic obstructive pulmonary disease", "Asthma", "Pneumonia", "Urinary tract infection", "Sepsis", "Cellulitis",
    "Obesity", "Hypothyroidism", "Hyperthyroidism", "Gastroesophageal reflux disease", "Peptic ulcer disease",
    "Acute pancreatitis", "Cirrhosis of liver", "Chronic hepatitis C", "Anemia", "Iron deficiency anemia",
    "Vitamin B12 deficiency", "Hypokalemia", "Hyponatremia", "Hyperkalemia", "Dehydration", "Deep vein thrombosis",
    "Pulmonary embolism", "Ischemic stroke", "Transient ischemic attack", "Epilepsy", "Migraine",
    "Major depressive disorder", "Generalized anxiety disorder", "Bipolar disorder", "Schizophrenia",
    "Alcohol use disorder", "Opioid use disorder", "Tobacco use disorder", "Dementia", "Delirium", "Parkinson disease",
    "Osteoarthritis of knee", "Rheumatoid arthritis", "Gout", "Osteoporosis", "Low back pain", "Hip fracture",
    "Benign prostatic hyperplasia", "Breast cancer", "Prostate cancer", "Colon cancer", "Lung cancer",
    "Acute bronchitis", "Viral sinusitis", "Streptococcal pharyngitis", "Otitis media", "COVID-19", "Influenza",
    "Obstructive sleep apnea", "Peripheral arterial disease", "Aortic stenosis", "Diabetic neuropathy",
    "Diabetic retinopathy", "Hypoglycemia", "Pressure ulcer", "Clostridioides difficile infection", "Diverticulitis",
    "Acute cholecystitis", "Acute respiratory failure", "Syncope", "Chest pain", "Fall",
)
PROCEDURES: tuple[str, ...] = (
    "Colonoscopy", "Upper gastrointestinal endoscopy", "Cardiac catheterization", "Percutaneous coronary intervention",
    "Coronary artery bypass graft", "Echocardiogram", "Electrocardiogram", "Chest X-ray", "CT of head",
    "CT of abdomen and pelvis", "CT angiography of chest", "MRI of brain", "MRI of lumbar spine",
    "Abdominal ultrasound", "Renal ultrasound", "Venous duplex ultrasound", "Carotid ultrasound", "Mammography",
    "Bone density scan", "Pulmonary function test", "Bronchoscopy", "Thoracentesis", "Paracentesis", "Lumbar puncture",
    "Central venous catheter placement", "Arterial line placement", "Endotracheal intubation",
    "Mechanical ventilation", "Hemodialysis", "Blood transfusion", "Appendectomy", "Cholecystectomy",
    "Total knee replacement", "Total hip replacement", "Hip fracture repair", "Cataract surgery", "Inguinal hernia repair",
    "Skin biopsy", "Prostate biopsy", "Cystoscopy", "Pacemaker insertion", "Electrical cardioversion",
    "Influenza vaccination", "Pneumococcal vaccination", "Tetanus vaccination", "Physical therapy evaluation",
    "Nutrition counseling", "Depression screening", "Medication reconciliation", "Wound debridement",
    "Incision and drainage of abscess", "Tracheostomy", "Feeding tube placement", "Dental cleaning",
)

GROUPS = ("lab", "vital", "med", "condition", "procedure")
MIX = {"lab": 0.40, "vital": 0.10, "med": 0.22, "condition": 0.16, "procedure": 0.12}
"""Share of a patient's chains per group."""
LENGTH_WEIGHT = {"lab": 3.0, "vital": 4.0, "med": 1.5, "condition": 1.0, "procedure": 0.4}
"""Relative share of the repeated facts (beyond each chain's first) per group."""
TERMINAL = {"med": 0.35, "condition": 0.4}
"""Probability that a chain ends stopped/completed (medications) or resolved (conditions)."""
BASE_TIME = datetime(2130, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Concept:
    index: int
    group: str
    category: Category
    display: str
    system: str
    code: str
    unit: str | None = None
    mean: float = 0.0
    sd: float = 0.0
    decimals: int = 0
    doses: tuple[float, ...] = ()

    @property
    def embed_text(self) -> str:
        return f"{self.category.value}: {self.display}"


@dataclass(frozen=True)
class Chain:
    concept: Concept
    instance: int
    length: int
    terminal: bool


def vocabulary() -> list[Concept]:
    """The concept vocabulary, in a fixed order (earlier = more common within its group)."""
    out: list[Concept] = []
    for group, table in (("lab", LABS), ("vital", VITALS)):
        for name, unit, mean, sd, dec in table:
            out.append(Concept(len(out), group, Category.OBSERVATION, name, CodeSystem.LOINC.value,
                               f"SYN-{len(out):04d}", unit=unit, mean=mean, sd=sd, decimals=dec))
    for name, unit, doses in MEDS:
        out.append(Concept(len(out), "med", Category.MEDICATION, name, CodeSystem.RXNORM.value, f"SYN-{len(out):04d}",
                           unit=unit, doses=doses))
    for group, names in (("condition", CONDITIONS), ("procedure", PROCEDURES)):
        category = Category.CONDITION if group == "condition" else Category.PROCEDURE
        for name in names:
            out.append(Concept(len(out), group, category, name, CodeSystem.SNOMED.value, f"SYN-{len(out):04d}"))
    return out


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))  # str seeds hash with sha512: stable


def plan_patient(index: int, vocab: list[Concept], *, memories: int, history_fraction: float,
                 seed: int) -> list[Chain]:
    """The chains of one patient: concept, instance, length and whether it ends in a terminal fact."""
    rng = _rng(seed, "plan", index)
    terminal_share = sum(MIX[g] * TERMINAL.get(g, 0.0) for g in GROUPS)
    n_chains = max(1, min(memories, round(memories * (1 - history_fraction) / (1 - terminal_share))))
    by_group: dict[str, list[Concept]] = {g: [c for c in vocab if c.group == g] for g in GROUPS}
    weights: dict[str, list[float]] = {}
    for g, concepts in by_group.items():  # Zipf-like popularity, and a patient-specific subset and emphasis
        w = [(0.0 if rng.random() < 0.3 else rng.uniform(0.5, 2.0)) / (rank + 1) ** 0.7
             for rank in range(len(concepts))]
        weights[g] = w if any(w) else [1.0] * len(concepts)
    groups = rng.choices(GROUPS, weights=[MIX[g] for g in GROUPS], k=n_chains)
    seen: Counter[int] = Counter()
    picked: list[tuple[Concept, int]] = []
    for g in groups:
        concept = rng.choices(by_group[g], weights=weights[g])[0]
        picked.append((concept, seen[concept.index]))
        seen[concept.index] += 1
    lengths = [1] * n_chains
    extra = memories - n_chains
    if extra > 0:
        for pos in rng.choices(range(n_chains), weights=[LENGTH_WEIGHT[c.group] for c, _ in picked], k=extra):
            lengths[pos] += 1
    return [Chain(concept=c, instance=inst, length=n, terminal=rng.random() < TERMINAL.get(c.group, 0.0))
            for (c, inst), n in zip(picked, lengths, strict=True)]


def _date(t: datetime) -> str:
    return t.date().isoformat()


def _fmt(x: float) -> str:
    return f"{x:g}"


def _memory(pid: str, entry_id: str, chain: Chain, ref: str, when: datetime, end: datetime | None, last: bool,
            rng: random.Random) -> AtomicMemory:
    c = chain.concept
    code = c.code if chain.instance == 0 else f"{c.code}-{chain.instance}"
    common: dict[str, Any] = {"memory_id": memory_id(pid, entry_id, 0), "patient_id": pid, "entry_id": entry_id,
              "position": 0,
              "category": c.category, "concept": Coding(system=c.system, code=code, display=c.display),
              "effective_start": when, "recorded_at": when + timedelta(minutes=rng.randint(5, 240)),
              "source_ref": ref, "embed_text": c.embed_text}
    if c.category is Category.OBSERVATION:
        value = round(max(rng.gauss(c.mean, c.sd), c.mean * 0.05), c.decimals)
        return AtomicMemory(**common, text=f"{c.display}: {_fmt(value)} {c.unit} ({_date(when)})",
                            status="final", value=value, unit=c.unit)
    terminal = chain.terminal and last
    if c.category is Category.MEDICATION:
        status = ("stopped" if rng.random() < 0.6 else "completed") if terminal else "active"
        dosage = f"{_fmt(rng.choice(c.doses))} {c.unit} {rng.choice(FREQUENCIES)}"
        parts = [f"Medication: {c.display}", f"dosage {dosage}", f"status {status}"]
    elif c.category is Category.CONDITION:
        status, dosage = ("resolved" if terminal else "active"), None
        parts = [f"Condition: {c.display}", f"status {status}"]
    else:
        status, dosage = "completed", None
        parts = [f"Procedure: {c.display}", f"status {status}"]
    ended = end if terminal else None
    parts.append(f"from {_date(when)}" + (f" to {_date(ended)}" if ended else ""))
    return AtomicMemory(**common, text="; ".join(parts), status=status, dosage=dosage, effective_end=ended)


_TERMINAL_REASON = {"stopped": Reason.STOPPED, "completed": Reason.COMPLETED, "resolved": Reason.RESOLVED}
_RESOURCE = {Category.OBSERVATION: "Observation", Category.MEDICATION: "MedicationRequest",
             Category.CONDITION: "Condition", Category.PROCEDURE: "Procedure"}


def build_patient(index: int, pid: str, chains: list[Chain], vectors: np.ndarray, *,
                  seed: int) -> tuple[PatientState, list[VectorRow]]:
    """The patient's state (version = number of memories, one entry each) and its vector rows."""
    rng = _rng(seed, "build", index)
    start = BASE_TIME + timedelta(days=rng.randint(0, 3650))
    span_s = rng.randint(365, 6 * 365) * 86400
    state = PatientState(patient_id=pid)
    rows: list[VectorRow] = []
    heads: dict[str, list[str]] = {g: [] for g in GROUPS}
    entry = 0
    for k, chain in enumerate(chains):
        times = sorted(start + timedelta(seconds=rng.randrange(span_s)) for _ in range(chain.length))
        mems: list[AtomicMemory] = []
        for j, when in enumerate(times):
            ref = f"{_RESOURCE[chain.concept.category]}/{pid}-{k}-{j}"
            end = when + timedelta(days=rng.randint(3, 120))
            mems.append(_memory(pid, f"{pid}:e{entry:06d}", chain, ref, when, end, j == len(times) - 1, rng))
            entry += 1
        vec = vectors[chain.concept.index]
        last = mems[-1]
        own = _TERMINAL_REASON.get(last.status or "") if chain.terminal else None
        for j, m in enumerate(mems):
            if j < len(mems) - 1:  # moved to HISTORY by the arrival of the next fact
                nxt = mems[j + 1]
                reason = own if (own is not None and j == len(mems) - 2) else Reason.SUPERSEDED
                state.add(m, Store.HISTORY, reason=reason, successor_id=nxt.memory_id, evidence_id=nxt.memory_id,
                          entry_id=nxt.entry_id, at=nxt.recorded_at)
                rows.append(VectorRow(m.memory_id, vec, Store.HISTORY))
            elif own is not None:  # a terminal fact is placed in HISTORY itself
                state.add(m, Store.HISTORY, reason=own, entry_id=m.entry_id, at=m.recorded_at)
                rows.append(VectorRow(m.memory_id, vec, Store.HISTORY))
            else:
                state.add(m, Store.ACTIVE)
                rows.append(VectorRow(m.memory_id, vec, Store.ACTIVE))
                heads[chain.concept.group].append(m.memory_id)
        for older, newer in zip(mems, mems[1:], strict=False):  # recorded when the newer fact arrived
            state.restore_relation(Relation(source_id=newer.memory_id, target_id=older.memory_id,
                                            type=RelationType.RESTATEMENT, weight=1.0))
    conditions = heads["condition"]
    if conditions:
        for mid in heads["med"]:
            state.restore_relation(Relation(source_id=mid, target_id=rng.choice(conditions),
                                            type=RelationType.TREATMENT_FOR, weight=0.9))
        for mid in heads["lab"]:
            if rng.random() < 0.3:
                state.restore_relation(Relation(source_id=mid, target_id=rng.choice(conditions),
                                                type=RelationType.MONITORING_FOR, weight=0.8))
    state.version = entry
    return state, rows


# --- questions -------------------------------------------------------------------------------------------

TEMPLATES: dict[str, tuple[str, ...]] = {
    "lab": ("What is the patient's {c}?", "Latest {c} value?", "{c} trend", "How has the {c} changed over time?",
            "Is the {c} within normal limits?", "What was the first {c} recorded?", "Current {c}"),
    "vital": ("What is the patient's {c}?", "{c} trend", "Latest {c}", "Has the {c} increased?"),
    "med": ("Was {c} ever stopped?", "What is the current {c} dose?", "Is the patient on {c}?",
            "Why was {c} discontinued?", "{c} dosage and frequency"),
    "condition": ("Does the patient have {c}?", "Is the {c} resolved?", "History of {c}?", "Status of {c}",
                  "How is the {c} being managed?"),
    "procedure": ("When was the {c} done?", "Has the patient had a {c}?", "{c} date", "Previous {c}?"),
}
FREE_QUESTIONS = (
    "How are the kidneys doing?", "Summarise the cardiac picture.", "How well controlled is the blood pressure?",
    "Any signs of infection?", "What does the patient take for diabetes?", "Is the patient anticoagulated?",
    "What are the active problems?", "Any recent lab abnormalities?", "What is the liver function like?",
    "How is the patient's breathing?", "What pain medication is the patient on?", "What imaging has been done?",
    "Is the patient at risk of bleeding?", "What is the thyroid status?", "How is the glucose control?",
    "What do the electrolytes look like?", "Any mental health conditions?", "What surgeries has the patient had?",
    "Which antibiotics are being given?", "What is the fluid status?",
)


def question(rng: random.Random, chains: list[Chain], vocab: list[Concept]) -> str:
    """A question: about a concept in the patient's record (mostly), any concept, or free phrasing."""
    r = rng.random()
    if r < 0.2:
        return rng.choice(FREE_QUESTIONS)
    concept = rng.choice(chains).concept if r < 0.85 else rng.choice(vocab)
    name = concept.display if concept.display[:2].isupper() else concept.display[0].lower() + concept.display[1:]
    text = rng.choice(TEMPLATES[concept.group]).format(c=name)
    return text[0].upper() + text[1:]
